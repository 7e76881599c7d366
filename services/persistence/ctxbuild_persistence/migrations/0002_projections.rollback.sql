DROP TABLE IF EXISTS persistence.file_references;
DROP TABLE IF EXISTS persistence.attachments;
DROP TABLE IF EXISTS persistence.compaction_summaries;
DROP TABLE IF EXISTS persistence.messages;
DROP TABLE IF EXISTS persistence.conversations;
DROP TABLE IF EXISTS persistence.projection_tracking;
