"""Message definitions kafka-python 3.0.12 lacks, in the JSON form of Kafka's own message
definitions (``clients/src/main/resources/common/message``), read by kafka-python's schema
loader: see protocol.share_messages."""
