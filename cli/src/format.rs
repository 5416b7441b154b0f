//! Text formatting for the CLI: RFC 3339 times from Unix milliseconds,
//! relative durations, hex, byte previews and aligned tables. Written here
//! rather than pulled from a date crate: the CLI only ever formats UTC.

use idemstore::Timestamp;
use std::fmt::Write as _;

/// Bytes of a response body shown unless `--full`.
pub(crate) const BODY_PREVIEW_BYTES: usize = 1024;

/// `2026-11-29T10:29:22.123Z` for a Unix time in milliseconds.
pub(crate) fn rfc3339(t: Timestamp) -> String {
    let ms = t.as_millis();
    let secs = ms / 1000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`, for non-negative days).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// A duration in milliseconds as its two largest units: `2d3h`, `5m12s`, `340ms`.
pub(crate) fn duration_ms(ms: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1000, "s"),
    ];
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let mut out = String::new();
    let mut rest = ms;
    let mut shown = 0;
    for (unit, name) in UNITS {
        if shown == 2 {
            break;
        }
        let n = rest / unit;
        if n > 0 || shown > 0 {
            if n > 0 {
                let _ = write!(out, "{n}{name}");
            }
            shown += 1;
        }
        rest %= unit;
    }
    out
}

/// `in 23h59m` or `2m ago` (or `now`), relative to `now`.
pub(crate) fn relative(t: Timestamp, now: Timestamp) -> String {
    let (a, b) = (t.as_millis(), now.as_millis());
    if a == b {
        "now".to_owned()
    } else if a > b {
        format!("in {}", duration_ms(a - b))
    } else {
        format!("{} ago", duration_ms(b - a))
    }
}

/// `2026-11-29T10:29:22.123Z (in 23h59m)`.
pub(crate) fn when(t: Timestamp, now: Timestamp) -> String {
    format!("{} ({})", rfc3339(t), relative(t, now))
}

/// Lower-case hex, no prefix.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A store id as 32 lower-case hex digits: its 16 bytes, big-endian, as
/// [`hex`] shows them.
pub(crate) fn store_id(id: u128) -> String {
    format!("{id:032x}")
}

/// How bytes are shown: as text when they are UTF-8, else as hex.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Preview {
    /// The text or the hex digits.
    pub(crate) shown: String,
    /// True when `shown` is hex.
    pub(crate) is_hex: bool,
    /// Bytes shown out of the whole.
    pub(crate) shown_bytes: usize,
    pub(crate) total_bytes: usize,
}

impl Preview {
    /// True when part of the bytes is not shown.
    pub(crate) fn truncated(&self) -> bool {
        self.shown_bytes < self.total_bytes
    }
}

/// Shows up to `limit` bytes (all when `None`): text if the whole is UTF-8
/// (cut at a character boundary), else hex.
pub(crate) fn preview(bytes: &[u8], limit: Option<usize>) -> Preview {
    let limit = limit.unwrap_or(usize::MAX).min(bytes.len());
    match std::str::from_utf8(bytes) {
        Ok(text) => {
            let mut cut = limit;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            Preview {
                shown: text.get(..cut).unwrap_or_default().to_owned(),
                is_hex: false,
                shown_bytes: cut,
                total_bytes: bytes.len(),
            }
        }
        Err(_) => Preview {
            shown: hex(bytes.get(..limit).unwrap_or_default()),
            is_hex: true,
            shown_bytes: limit,
            total_bytes: bytes.len(),
        },
    }
}

/// Columns padded to the widest cell; the last column is not padded.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut first = true;
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if !first {
                text.push_str("  ");
            }
            first = false;
            text.push_str(cell);
            let pad = widths
                .get(i)
                .copied()
                .unwrap_or(0)
                .saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339(Timestamp::EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(Timestamp::from_millis(1_700_000_000_123)),
            "2023-11-14T22:13:20.123Z"
        );
        // A leap day and the day after.
        assert_eq!(
            rfc3339(Timestamp::from_millis(951_782_400_000)),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(
            rfc3339(Timestamp::from_millis(951_868_800_000)),
            "2000-03-01T00:00:00.000Z"
        );
        assert_eq!(
            rfc3339(Timestamp::from_millis(4_102_444_799_999)),
            "2099-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn rfc3339_agrees_with_day_arithmetic_for_every_day_of_four_centuries() {
        // Walk day by day from 1970 and check the date advances like a calendar.
        let (mut y, mut m, mut d) = (1970u64, 1u64, 1u64);
        for day in 0..146_097u64 {
            assert_eq!(civil_from_days(day), (y, m, d), "day {day}");
            let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
            let len = match m {
                2 if leap => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            d += 1;
            if d > len {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
    }

    #[test]
    fn durations_show_two_units() {
        assert_eq!(duration_ms(0), "0ms");
        assert_eq!(duration_ms(999), "999ms");
        assert_eq!(duration_ms(1000), "1s");
        assert_eq!(duration_ms(61_000), "1m1s");
        assert_eq!(duration_ms(3_600_000), "1h");
        assert_eq!(duration_ms(3_661_000), "1h1m");
        assert_eq!(duration_ms(86_400_000 + 5_000), "1d");
        assert_eq!(duration_ms(2 * 86_400_000 + 3 * 3_600_000), "2d3h");
        let now = Timestamp::from_millis(10_000);
        assert_eq!(relative(Timestamp::from_millis(70_000), now), "in 1m");
        assert_eq!(relative(Timestamp::from_millis(4_000), now), "6s ago");
        assert_eq!(relative(now, now), "now");
    }

    #[test]
    fn previews_are_text_or_hex_and_cut_at_characters() {
        let p = preview("héllo".as_bytes(), Some(2));
        assert_eq!(
            (p.shown.as_str(), p.is_hex, p.truncated()),
            ("h", false, true)
        );
        let p = preview(&[0xff, 0x00, 0x10], None);
        assert_eq!(
            (p.shown.as_str(), p.is_hex, p.truncated()),
            ("ff0010", true, false)
        );
    }

    #[test]
    fn store_ids_are_their_bytes_in_hex() {
        let id = 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10_u128;
        assert_eq!(store_id(id), hex(&id.to_be_bytes()));
        assert_eq!(store_id(1), format!("{}01", "0".repeat(30)));
    }

    #[test]
    fn tables_align_columns() {
        let out = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(out, "A    BB\nxxx  y\n");
    }
}
