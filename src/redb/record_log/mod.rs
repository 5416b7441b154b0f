//! The record log (`<file>-wal`): a group becomes durable with one aligned
//! append and one `fdatasync`, not a redb commit. `frame.rs` holds the bytes,
//! `writer.rs` the appends, `reader.rs` the walk; the segment and epoch
//! rules are in docs/design.md and docs/format.md.
//!
//! Invariants: a frame is `fdatasync`ed before the memtable sees its records
//! or a caller is answered; a segment is reused only once its epoch is
//! retired by a durable checkpoint commit; every write transaction outside
//! the line takes in the memtable and moves the epoch on
//! ([`Shared::direct`](super::Shared)), else a replay of older frames would
//! undo it.

use std::time::Duration;

mod frame;
mod reader;
mod writer;

pub(crate) use frame::FRAME_ALIGN;
pub(super) use frame::{FrameBuf, Layout, entries};
pub(super) use reader::{Seen, applier, walk};
pub(super) use writer::LogWriter;

/// Size of a store's log file: two segments of half this size, zero-filled
/// at creation so that an append's `fdatasync` has no metadata to write.
pub(crate) const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`log_bytes`): two segments of two
/// aligned 4 KiB blocks each.
pub(crate) const MIN_WAL_BYTES: u64 = 4 * FRAME_ALIGN;

/// Longest time a logged write stays only in the memtable and the log
/// before the checkpointer writes it into the store file: it bounds a
/// replay after a crash.
pub(crate) const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);
