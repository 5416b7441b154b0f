//! Keys on the command line and in JSON: a key is always its two parts
//! (scope and id), as text when they are printable UTF-8 and as hex when
//! not, so that `a/b` + `c` and `a` + `b/c` never read the same and a key
//! with any bytes can be listed and then addressed (`--hex`).

use super::Failure;
use super::format::hex;
use idemstore::Key;
use idemstore::redb::admin::RawKey;
use serde_json::{Map, Value, json};

/// A key given on the command line: `KEY` and `--scope`.
#[derive(Debug, clap::Args)]
pub(crate) struct KeyArg {
    /// The key's id (the Idempotency-Key).
    pub(crate) key: String,
    /// The key's scope (tenant); empty when not given.
    #[arg(long, default_value = "")]
    pub(crate) scope: String,
    /// KEY and --scope are hex digits (with or without 0x), for keys whose
    /// bytes are not printable text (`list` shows them as 0x...).
    #[arg(long)]
    pub(crate) hex: bool,
}

impl KeyArg {
    /// The key these arguments name.
    pub(crate) fn key(&self) -> Result<Key, Failure> {
        if !self.hex {
            return Ok(Key::new(self.scope.as_str(), self.key.as_str())?);
        }
        Ok(Key::new(
            unhex(&self.scope, "--scope")?,
            unhex(&self.key, "KEY")?,
        )?)
    }
}

/// Hex digits (an optional `0x` first) as bytes.
pub(crate) fn unhex(text: &str, what: &str) -> Result<Vec<u8>, Failure> {
    let digits = text.strip_prefix("0x").unwrap_or(text);
    let bad = || {
        Failure::new(
            super::EXIT_USAGE,
            format!("{what} {text:?} is not hex digits (pairs of 0-9, a-f)"),
        )
    };
    if !digits.len().is_multiple_of(2) {
        return Err(bad());
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| {
            digits
                .get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

/// Printable UTF-8 (no control characters), as `Key`'s display shows text.
fn printable(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes)
        .ok()
        .filter(|s| s.chars().all(|c| !c.is_control()))
}

fn put_part(map: &mut Map<String, Value>, name: &str, bytes: &[u8]) {
    match printable(bytes) {
        Some(text) => map.insert(name.to_owned(), json!(text)),
        None => map.insert(
            format!("{name}_hex"),
            json!(hex(bytes).trim_start_matches("0x")),
        ),
    };
}

/// `{"scope": .., "id": ..}`, a part that is not printable text as
/// `scope_hex` / `id_hex` instead.
pub(crate) fn key_json(key: &Key) -> Value {
    let mut map = Map::new();
    put_part(&mut map, "scope", key.scope());
    put_part(&mut map, "id", key.id());
    Value::Object(map)
}

/// [`key_json`] of a stored key; `{"raw_hex": ..}` when its bytes are not
/// a valid key (a damaged file).
pub(crate) fn raw_key_json(key: RawKey<'_>) -> Value {
    match key.decode() {
        Ok(key) => key_json(&key),
        Err(_) => json!({"raw_hex": hex(key.as_bytes()).trim_start_matches("0x")}),
    }
}

/// How to name `key` on the command line again: `--scope S KEY`, with
/// `--hex` when a part is not printable.
pub(crate) fn command_line_form(key: &Key) -> String {
    match (printable(key.scope()), printable(key.id())) {
        (Some(""), Some(id)) => shell_word(id),
        (Some(scope), Some(id)) => format!("--scope {} {}", shell_word(scope), shell_word(id)),
        _ => format!(
            "--hex --scope {} {}",
            hex(key.scope()).trim_start_matches("0x"),
            hex(key.id()).trim_start_matches("0x")
        ),
    }
}

/// How a key is shown in text: `scope/id` when both parts are printable,
/// else the arguments that address it (`--hex --scope .. ..`).
pub(crate) fn shown(key: &Key) -> String {
    let form = command_line_form(key);
    if form.starts_with("--hex") {
        form
    } else {
        key.to_string()
    }
}

/// [`shown`] of a stored key; its hex bytes when they are not a valid key.
pub(crate) fn raw_shown(key: RawKey<'_>) -> String {
    key.decode().map_or_else(|_| key.to_string(), |k| shown(&k))
}

/// `word` quoted for a POSIX shell when it needs it.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:@%+=,".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_in_json_keep_their_parts_apart() {
        let a = key_json(&Key::new("a/b", "c").expect("key"));
        let b = key_json(&Key::new("a", "b/c").expect("key"));
        assert_ne!(a, b);
        assert_eq!(a, json!({"scope": "a/b", "id": "c"}));
        let binary = key_json(&Key::new("t", [0x74, 0xff]).expect("key"));
        assert_eq!(binary, json!({"scope": "t", "id_hex": "74ff"}));
    }

    #[test]
    fn hex_arguments_address_any_key() {
        let arg = KeyArg {
            key: "0x74ff".into(),
            scope: "74".into(),
            hex: true,
        };
        assert_eq!(
            arg.key().expect("key"),
            Key::new("t", [0x74, 0xff]).expect("key")
        );
        let bad = KeyArg {
            key: "7g".into(),
            scope: String::new(),
            hex: true,
        };
        assert!(bad.key().is_err());
        assert!(unhex("abc", "KEY").is_err());
    }

    #[test]
    fn the_command_line_form_names_the_key_again() {
        assert_eq!(command_line_form(&Key::new("", "k1").expect("key")), "k1");
        assert_eq!(
            command_line_form(&Key::new("t", "it's").expect("key")),
            r"--scope t 'it'\''s'"
        );
        assert_eq!(
            command_line_form(&Key::new("t", [0xff]).expect("key")),
            "--hex --scope 74 ff"
        );
    }
}
