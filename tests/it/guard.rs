//! Guard policies beyond the conformance suite (on `MemoryStore`).
