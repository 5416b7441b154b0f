//! The record log (`<file>-wal`): a group becomes durable with one aligned
//! append and one `fdatasync`, not a redb commit that rewrites every page it
//! touched. This file: the log's sizes; `frame.rs`
//! the bytes (docs/format.md), `writer.rs` the appends, `reader.rs` the walk.
//!
//! Invariants (`Durability::Immediate`):
//!
//! 1. A group's records and token high-water mark go to the log as one
//!    frame, which is `fdatasync`ed before the memtable sees the records or
//!    a caller is answered: nothing is visible before it is durable.
//! 2. Two segments; epoch `e` writes segment `e % 2`. A freeze moves the log
//!    to `e + 1` while the checkpoint writes `e`'s records into redb; its
//!    durable commit stores `e + 1` as the durable epoch, which retires all
//!    of `e` in that one commit. A segment is reused only once its epoch is
//!    retired (a freeze waits for the running checkpoint).
//! 3. An open replays epoch `E` (segment `E % 2`), then `E + 1`, commits
//!    durably, and writes `E + 2`.
//! 4. A frame starts on a fresh 4 KiB block, so an append never rewrites a
//!    sector holding acknowledged bytes: a torn sector damages only the
//!    frame being written.
//! 5. Every write transaction outside the line takes in the memtable and
//!    then moves the epoch on ([`Shared::direct`](super::Shared)): replaying
//!    older frames over its writes would undo them.

use std::time::Duration;

mod frame;
mod reader;
mod writer;

pub(crate) use frame::FRAME_ALIGN;
pub(super) use frame::{FrameBuf, Layout, entries};
pub(super) use reader::{Seen, applier, walk};
pub(super) use writer::LogWriter;

/// Size of a store's log file (`<file>-wal`): two segments of
/// half this size. Zero-filled at creation, so an append changes neither
/// size nor allocation and `fdatasync` has no metadata to write.
pub(crate) const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`log_bytes`): two segments of two
/// aligned 4 KiB blocks each.
pub(crate) const MIN_WAL_BYTES: u64 = 4 * FRAME_ALIGN;

/// Longest time a logged write stays only in the memtable and the log
/// before the background checkpointer starts writing it into the store
/// file (an idle store is checkpointed too). It bounds the work of a
/// replay after a crash.
pub(crate) const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);
