//! Page images over a file: the bytes of every page written, kept in
//! memory. Shared by the read-only overlay (overlay.rs) and the page log
//! (backend.rs); a bottom module, importing neither.

use std::collections::HashMap;

/// The unit of the images: redb's pages are multiples of it.
pub(super) const PAGE: u64 = 4096;

/// Page images over a file: the latest bytes of every page written, by
/// index, each [`PAGE`] long. Reads and writes take the bytes no image
/// covers from `file(offset, out)`. Shared by the read-only overlay
/// (overlay.rs) and the page log (backend.rs).
#[derive(Default)]
pub(super) struct Pages(HashMap<u64, Box<[u8]>>);

impl Pages {
    pub(super) fn clear(&mut self) {
        self.0.clear();
    }

    /// Forgets everything at or past `len`, zeros included (a cut file).
    pub(super) fn cut(&mut self, len: u64) {
        self.0.retain(|&index, _| index * PAGE < len);
        let from = (len % PAGE) as usize;
        if let Some(page) = self.0.get_mut(&(len / PAGE)) {
            page.get_mut(from..).unwrap_or_default().fill(0);
        }
    }

    /// The images in file order, with their offsets.
    pub(super) fn in_order(&self) -> Vec<(u64, &[u8])> {
        let mut pages: Vec<(u64, &[u8])> =
            self.0.iter().map(|(&i, p)| (i * PAGE, &p[..])).collect();
        pages.sort_unstable_by_key(|&(at, _)| at);
        pages
    }

    /// Fills `out` from offset `offset`: images where there are, else `file`.
    pub(super) fn read(
        &self,
        offset: u64,
        out: &mut [u8],
        file: impl Fn(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if self.0.is_empty() {
            return file(offset, out);
        }
        let mut done = 0usize;
        while done < out.len() {
            let at = offset + done as u64;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(out.len() - done);
            let to = out.get_mut(done..done + n).unwrap_or_default();
            match self.0.get(&(at / PAGE)) {
                Some(page) => to.copy_from_slice(page.get(from..from + n).unwrap_or_default()),
                None => file(at, to)?,
            }
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at `offset` into the images; a page written in part
    /// starts from its current bytes (its image, else `file`).
    pub(super) fn write(
        &mut self,
        offset: u64,
        data: &[u8],
        file: impl Fn(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(data.len() - done);
            let mut page = match self.0.remove(&index) {
                Some(page) => page,
                None => {
                    let mut page = vec![0u8; PAGE as usize].into_boxed_slice();
                    // A whole page needs nothing of the old one.
                    if n < PAGE as usize {
                        file(index * PAGE, &mut page)?;
                    }
                    page
                }
            };
            page.get_mut(from..from + n)
                .unwrap_or_default()
                .copy_from_slice(data.get(done..done + n).unwrap_or_default());
            self.0.insert(index, page);
            done += n;
        }
        Ok(())
    }
}
