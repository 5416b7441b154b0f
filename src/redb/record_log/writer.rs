//! The record log's writer: [`LogWriter`] appends a group's [`FrameBuf`] as
//! one frame at the next aligned offset of the epoch's segment.

use super::frame::{FRAME_HEADER, FrameBuf, Layout, align_up, segment_bytes};
use crate::error::{Error, Result};
use ::redb::StorageBackend;

/// The log file and where the next frame goes.
#[derive(Debug)]
pub(in crate::redb) struct LogWriter {
    file: std::sync::Arc<dyn StorageBackend>,
    epoch: u64,
    /// From the start of the epoch's segment.
    offset: u64,
    /// The file's size when opened: it fixes the segments.
    len: u64,
    /// Every frame's CRC covers it, so no other store's frames verify here.
    store_id: [u8; 16],
}

impl LogWriter {
    pub(in crate::redb) fn new(
        file: std::sync::Arc<dyn StorageBackend>,
        store_id: [u8; 16],
        epoch: u64,
        len: u64,
    ) -> LogWriter {
        LogWriter {
            file,
            epoch,
            offset: 0,
            len,
            store_id,
        }
    }

    pub(in crate::redb) fn file(&self) -> std::sync::Arc<dyn StorageBackend> {
        std::sync::Arc::clone(&self.file)
    }

    pub(in crate::redb) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How full the current epoch's segment is, 0..=1 (a metric).
    pub(in crate::redb) fn fill(&self) -> f64 {
        let segment = segment_bytes(self.len);
        if segment == 0 {
            return 0.0;
        }
        self.offset as f64 / segment as f64
    }

    pub(in crate::redb) fn is_dirty(&self) -> bool {
        self.offset > 0
    }

    /// A frame with this many payload bytes fits in what is left of the segment.
    pub(in crate::redb) fn fits(&self, payload_bytes: usize) -> bool {
        self.offset + align_up(FRAME_HEADER + payload_bytes as u64) <= segment_bytes(self.len)
    }

    /// A frame with this many payload bytes fits in an empty segment.
    pub(in crate::redb) fn fits_at_all(&self, payload_bytes: usize) -> bool {
        align_up(FRAME_HEADER + payload_bytes as u64) <= segment_bytes(self.len)
    }

    /// New frames go to the next epoch, in the other segment (a checkpoint
    /// took the current epoch's records).
    pub(in crate::redb) fn rotate(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.offset = 0;
    }

    /// Appends `frame` as one frame, on an aligned offset, and makes it
    /// durable when `sync`. An error leaves the frame's fate unknown: the
    /// caller must not publish the group and must poison the store.
    pub(in crate::redb) fn append(&mut self, frame: &mut FrameBuf, sync: bool) -> Result<()> {
        let start = Layout::segment(self.len, self.epoch).region.start + self.offset;
        let frame = frame.seal(&self.store_id, self.epoch)?;
        let framed = align_up(frame.len() as u64);
        self.file.write(start, frame).map_err(Error::Io)?;
        if sync {
            self.file.sync_data().map_err(Error::Io)?;
        }
        self.offset += framed;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::frame::{FRAME_ALIGN, Frame, Layout, read_frame};
    use super::super::reader::{applier, walk};
    use super::*;
    use crate::redb::tables::commit;

    #[test]
    fn appends_start_on_aligned_offsets_in_the_epochs_segment_and_rotate() {
        let file = std::sync::Arc::new(::redb::backends::InMemoryBackend::new());
        let len = 4 * FRAME_ALIGN;
        file.set_len(len).unwrap();
        let mut wal = LogWriter::new(file.clone(), [3; 16], 5, len);
        let frame = |n: usize| {
            let record = crate::record::Record {
                fingerprint: crate::fingerprint::Fingerprint::of(b"x"),
                state: crate::record::State::Done,
                response: Some(crate::response::Response::new(200, vec![7; n])),
                lease_until: None,
                expires_at: crate::time::Timestamp::from_millis(10),
                created_at: crate::time::Timestamp::from_millis(1),
                token: 1,
                attempts: 1,
                steps: Vec::new(),
            };
            let mut j = FrameBuf::default();
            j.record_put(b"\0k", &crate::codec::encode_record(&record).unwrap());
            j
        };
        // Epoch 5 writes segment 1; each frame takes whole blocks.
        assert!(wal.fits(100) && !wal.is_dirty());
        assert_eq!(wal.fill(), 0.0);
        wal.append(&mut frame(100), true).unwrap();
        assert!(wal.is_dirty());
        assert!(wal.fits(100));
        assert_eq!(wal.fill(), 0.5, "one block of the segment's two");
        let shown = format!("{wal:?}");
        assert!(
            shown.contains("epoch: 5") && shown.contains(&format!("offset: {FRAME_ALIGN}")),
            "{shown}"
        );
        wal.append(&mut frame(100), true).unwrap();
        assert_eq!(wal.fill(), 1.0);
        // The segment (two blocks) is full.
        assert!(!wal.fits(1) && wal.fits_at_all(1));
        assert!(!wal.fits_at_all(2 * FRAME_ALIGN as usize));
        let first = 2 * FRAME_ALIGN;
        let read = |at, epoch| read_frame(file.as_ref(), &[3; 16], epoch, at, len).unwrap();
        assert!(matches!(read(first, 5), Frame::Whole { .. }));
        assert!(matches!(read(first + FRAME_ALIGN, 5), Frame::Whole { .. }));
        assert!(matches!(read(0, 5), Frame::End));
        // The next epoch starts at the start of the other segment.
        wal.rotate();
        assert_eq!(wal.epoch(), 6);
        assert!(!wal.is_dirty());
        wal.append(&mut frame(10), false).unwrap();
        assert!(matches!(read(0, 6), Frame::Whole { .. }));
        // Replay follows the aligned starts and stops at the segment's end.
        let db = ::redb::Database::builder()
            .create_with_backend(::redb::backends::InMemoryBackend::new())
            .unwrap();
        let walked = |epoch| {
            commit(&db, false, |t| {
                let layout = Layout::segment(len, epoch);
                let seen = &mut super::super::reader::Seen::default();
                walk(
                    file.as_ref(),
                    &[3; 16],
                    &layout,
                    false,
                    None,
                    seen,
                    applier(t, &mut 0),
                )
            })
            .unwrap()
            .unwrap()
        };
        assert_eq!(walked(5), 2);
        assert_eq!(walked(6), 1);
    }
}
