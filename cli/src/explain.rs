//! `explain` (what a request with a key would get now, and why) and
//! `fingerprint` (a request's fingerprint, as the library and the HTTP
//! layer compute it).
//!
//! `explain` decides with the library's own state machine
//! (`idemstore::logic::begin`) on the record as stored, so its answer is
//! the store's, not a re-implementation of it.

use super::format::{duration_ms, rfc3339, when};
use super::keys::{key_json, shown};
use super::{EXIT_OK, EXIT_USAGE, Failure, Io, Outcome};
use idemstore::limits::{DEFAULT_LEASE, DEFAULT_RETENTION, MAX_JSON_FIELDS};
use idemstore::{Begin, Fingerprint, JsonPointer, Key, Record, RedbStore, State, logic};
use serde_json::json;
use std::path::PathBuf;

/// How a request's fingerprint is computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// As the HTTP layer (`IdempotencyLayer`): method, path and query,
    /// body, then the configured headers (`Fingerprint::of_http`; with
    /// --json-field, `Fingerprint::of_http_json_fields`).
    #[default]
    Http,
    /// The body's bytes alone (`Fingerprint::of`), as a `Guard` caller
    /// that fingerprints a payload does.
    Bytes,
    /// The body as JSON in canonical form (`Fingerprint::of_json`; with
    /// --json-field, `Fingerprint::of_json_fields`): key order and
    /// whitespace do not matter.
    Json,
}

/// A request, for `fingerprint` and `explain`.
#[derive(Debug, clap::Args)]
pub(crate) struct RequestArgs {
    /// How the fingerprint is computed.
    #[arg(long, value_enum, default_value = "http")]
    pub(crate) kind: Kind,
    /// The request's method (--kind http).
    #[arg(long)]
    pub(crate) method: Option<String>,
    /// The request's path and query, as sent (`/orders?dry=1`) (--kind http).
    #[arg(long)]
    pub(crate) path: Option<String>,
    /// A header the layer is configured to include (`fingerprint_headers`),
    /// as `name: value`, in the layer's order; repeat a name for each of
    /// its values, and give `name:` alone for a configured header the
    /// request does not have (--kind http).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    pub(crate) header: Vec<String>,
    /// A field of the JSON body that the layer fingerprints
    /// (`fingerprint_json_fields`), as an RFC 6901 JSON Pointer (`/amount`);
    /// repeat it for each field, in any order. The body must be JSON
    /// (--kind http or json).
    #[arg(long = "json-field", value_name = "POINTER")]
    pub(crate) json_field: Vec<String>,
    /// The request body (a file; `-` for standard input). Empty when not given.
    #[arg(long)]
    pub(crate) body: Option<PathBuf>,
}

/// A fingerprint to compare with the stored one, and what it was computed from.
#[derive(Debug)]
pub(crate) struct Given {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) from: String,
}

impl Given {
    pub(crate) fn parse_hex(text: &str) -> Result<Given, Failure> {
        let bytes = super::keys::unhex(text, "--fingerprint")?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| {
            Failure::new(EXIT_USAGE, "--fingerprint must be 64 hex digits (32 bytes)")
        })?;
        Ok(Given {
            fingerprint: Fingerprint::from_bytes(bytes),
            from: "--fingerprint".to_owned(),
        })
    }
}

impl RequestArgs {
    /// The request's fingerprint, or `None` when no request option was given.
    pub(crate) fn fingerprint_if_given(&self) -> Result<Option<Given>, Failure> {
        let given = self.body.is_some()
            || self.method.is_some()
            || self.path.is_some()
            || !self.header.is_empty()
            || !self.json_field.is_empty();
        if !given {
            return Ok(None);
        }
        self.fingerprint().map(Some)
    }

    /// The request's fingerprint and a one-line account of what went in.
    pub(crate) fn fingerprint(&self) -> Result<Given, Failure> {
        let body = match &self.body {
            None => Vec::new(),
            Some(p) if p.as_os_str() == "-" => {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)?;
                buf
            }
            Some(p) => std::fs::read(p).map_err(|e| {
                Failure::new(
                    super::EXIT_ERROR,
                    format!("cannot read {}: {e}", p.display()),
                )
            })?,
        };
        let body_desc = format!("{} body bytes", body.len());
        if self.kind != Kind::Http
            && (self.method.is_some() || self.path.is_some() || !self.header.is_empty())
        {
            return Err(Failure::new(
                EXIT_USAGE,
                "--method, --path and --header are for --kind http",
            ));
        }
        let fields = parse_fields(&self.json_field)?;
        if self.kind == Kind::Bytes && !fields.is_empty() {
            return Err(Failure::new(
                EXIT_USAGE,
                "--json-field is for --kind http or --kind json",
            ));
        }
        // With fields, the body must be JSON, as the layer requires (it
        // answers 400 to a body that is not).
        let fields_of = || -> Result<Option<serde_json::Value>, Failure> {
            if fields.is_empty() {
                return Ok(None);
            }
            serde_json::from_slice(&body).map(Some).map_err(|e| {
                Failure::new(
                    super::EXIT_ERROR,
                    format!(
                        "the body is not JSON ({e}); with --json-field the layer answers 400 \
                         (Problem::BodyNotJson) and runs no handler"
                    ),
                )
            })
        };
        match self.kind {
            Kind::Bytes => Ok(Given {
                fingerprint: Fingerprint::of(&body),
                from: format!("Fingerprint::of over {body_desc}"),
            }),
            Kind::Json => {
                if let Some(doc) = fields_of()? {
                    return Ok(Given {
                        fingerprint: Fingerprint::of_json_fields(&doc, &fields),
                        from: format!(
                            "Fingerprint::of_json_fields over {body_desc}, fields [{}]",
                            describe_fields(&doc, &fields)
                        ),
                    });
                }
                let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
                    Failure::new(super::EXIT_ERROR, format!("the body is not JSON: {e}"))
                })?;
                Ok(Given {
                    fingerprint: Fingerprint::of_json(&value),
                    from: format!("Fingerprint::of_json over {body_desc}"),
                })
            }
            Kind::Http => {
                let (Some(method), Some(path)) = (&self.method, &self.path) else {
                    return Err(Failure::new(
                        EXIT_USAGE,
                        "--kind http (the default) needs --method and --path \
                         (or use --kind bytes or --kind json for a body alone)",
                    ));
                };
                let headers = parse_headers(&self.header)?;
                let borrowed: Vec<(&str, Vec<&[u8]>)> = headers
                    .iter()
                    .map(|(n, vs)| (n.as_str(), vs.iter().map(|v| v.as_bytes()).collect()))
                    .collect();
                let refs: Vec<(&str, &[&[u8]])> =
                    borrowed.iter().map(|(n, vs)| (*n, vs.as_slice())).collect();
                let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
                let names = names.join(", ");
                Ok(match &fields_of()? {
                    None => Given {
                        fingerprint: Fingerprint::of_http(method, path, &body, &refs),
                        from: format!(
                            "the HTTP layer's: {method} {path}, {body_desc}, headers [{names}]"
                        ),
                    },
                    Some(doc) => Given {
                        fingerprint: Fingerprint::of_http_json_fields(
                            method, path, doc, &fields, &refs,
                        ),
                        from: format!(
                            "the HTTP layer's with JSON fields: {method} {path}, {body_desc}, \
                             fields [{}], headers [{names}]",
                            describe_fields(doc, &fields)
                        ),
                    },
                })
            }
        }
    }
}

/// The --json-field pointers, checked as the layer checks them (sorted,
/// without repeats: the fingerprint takes them as a set).
fn parse_fields(args: &[String]) -> Result<Vec<JsonPointer>, Failure> {
    let mut fields = args
        .iter()
        .map(|p| {
            JsonPointer::new(p.as_str())
                .map_err(|e| Failure::new(EXIT_USAGE, format!("--json-field {p:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    fields.sort();
    fields.dedup();
    if fields.len() > MAX_JSON_FIELDS {
        return Err(Failure::new(
            EXIT_USAGE,
            format!(
                "{} --json-field pointers; at most {MAX_JSON_FIELDS} are allowed",
                fields.len()
            ),
        ));
    }
    Ok(fields)
}

/// Longest value shown for a field in a fingerprint's account.
const SHOWN_VALUE_CHARS: usize = 60;

/// `/amount = 1250, /note absent`: what each field contributed, so that an
/// operator comparing two requests sees which value differs.
fn describe_fields(doc: &serde_json::Value, fields: &[JsonPointer]) -> String {
    let shown: Vec<String> = fields
        .iter()
        .map(|p| match p.get(doc) {
            None => format!("{p} absent"),
            Some(v) => {
                let text = v.to_string();
                if text.chars().count() > SHOWN_VALUE_CHARS {
                    let cut: String = text.chars().take(SHOWN_VALUE_CHARS).collect();
                    format!("{p} = {cut}...")
                } else {
                    format!("{p} = {text}")
                }
            }
        })
        .collect();
    shown.join(", ")
}

/// `name: value` arguments grouped by name in first-seen order (names
/// lower-cased, as HTTP's are); `name:` alone is a header with no value.
fn parse_headers(args: &[String]) -> Result<Vec<(String, Vec<String>)>, Failure> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for arg in args {
        let Some((name, value)) = arg.split_once(':') else {
            return Err(Failure::new(
                EXIT_USAGE,
                format!("--header {arg:?} is not `name: value`"),
            ));
        };
        let name = name.trim().to_ascii_lowercase();
        if name.is_empty() {
            return Err(Failure::new(
                EXIT_USAGE,
                format!("--header {arg:?} has no name"),
            ));
        }
        let value = value.trim();
        let slot = match out.iter().position(|(n, _)| *n == name) {
            Some(i) => out.get_mut(i),
            None => {
                out.push((name, Vec::new()));
                out.last_mut()
            }
        };
        if let Some((_, values)) = slot
            && !value.is_empty()
        {
            values.push(value.to_owned());
        }
    }
    Ok(out)
}

pub(crate) fn fingerprint(request: &RequestArgs, io: &mut Io<'_>) -> Outcome {
    let given = request.fingerprint()?;
    if io.json {
        let v = json!({"fingerprint": given.fingerprint.to_hex(), "from": given.from});
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(io.out, "{}", given.fingerprint.to_hex())?;
        writeln!(io.err, "from {}", given.from)?;
    }
    Ok(EXIT_OK)
}

/// What `explain` concludes.
struct Verdict {
    /// `claim`, `takeover`, `replay`, `in_flight`, `conflict` or `damaged`.
    name: &'static str,
    /// The status the HTTP layer answers with (`None`: the handler's own).
    http: Option<u16>,
    why: String,
}

pub(crate) fn explain(
    store: &RedbStore,
    key: &Key,
    given: Option<&Given>,
    io: &mut Io<'_>,
) -> Outcome {
    let now = io.now;
    let hwm = store.admin().facts()?.token_hwm;
    let record = store.admin().get_raw(key);
    let verdict = match &record {
        Err(e) => Verdict {
            name: "damaged",
            http: Some(503),
            why: format!(
                "the record does not verify ({e}): the store answers Error::Corrupt and the \
                 request is not processed (the layer answers 503); run `idemstore verify`"
            ),
        },
        Ok(existing) => decide(existing.as_ref(), given, now, hwm)?,
    };
    let record = record.ok().flatten();
    let matches = match (&record, given) {
        (Some(r), Some(g)) => Some(*r.fingerprint() == g.fingerprint),
        _ => None,
    };
    if io.json {
        let v = json!({
            "key": key_json(key),
            "now_ms": now.as_millis(),
            "record": record.as_ref().map(|r| json!({
                "state": r.state().to_string(),
                "token": r.token(),
                "attempts": r.attempts(),
                "fingerprint": r.fingerprint().to_hex(),
                "lease_until_ms": r.lease_until().map(idemstore::Timestamp::as_millis),
                "expires_at_ms": r.expires_at().as_millis(),
                "expired": r.is_expired(now),
                "status": r.response().map(idemstore::Response::status),
                "steps": r.steps().iter().map(idemstore::Step::name).collect::<Vec<_>>(),
            })),
            "request_fingerprint": given.map(|g| g.fingerprint.to_hex()),
            "request_fingerprint_from": given.map(|g| g.from.clone()),
            "fingerprint_matches": matches,
            "verdict": verdict.name,
            "http_status": verdict.http,
            "why": verdict.why,
        });
        writeln!(io.out, "{v}")?;
        return Ok(EXIT_OK);
    }
    let mut lines = vec![format!("key          {}", shown(key))];
    match &record {
        None => lines.push("record       none".to_owned()),
        Some(r) => {
            lines.push(format!(
                "record       {}, token {}, {} attempt{}",
                r.state(),
                r.token(),
                r.attempts(),
                if r.attempts() == 1 { "" } else { "s" }
            ));
            lines.push(format!("created      {}", when(r.created_at(), now)));
            if let Some(lease) = r.lease_until() {
                lines.push(format!("lease until  {}", when(lease, now)));
            }
            if !r.steps().is_empty() {
                lines.push(format!("steps        {}", step_names(r)));
            }
            lines.push(format!("expires      {}", when(r.expires_at(), now)));
            if let Some(resp) = r.response() {
                lines.push(format!("stored       status {}", resp.status()));
            }
            lines.push(format!(
                "fingerprint  {} (stored)",
                r.fingerprint().to_hex()
            ));
        }
    }
    if let Some(g) = given {
        let note = match matches {
            Some(true) => "matches",
            Some(false) => "DIFFERS",
            None => "no stored one",
        };
        lines.push(format!(
            "request      {} ({note}; from {})",
            g.fingerprint.to_hex(),
            g.from
        ));
    }
    lines.push(format!(
        "now          {} ({} ms)",
        rfc3339(now),
        now.as_millis()
    ));
    let status = verdict.http.map_or_else(
        || "the handler runs and its response is the answer".to_owned(),
        |s| format!("HTTP {s}"),
    );
    lines.push(format!(
        "verdict      {} ({status})",
        verdict.name.to_uppercase()
    ));
    for line in &lines {
        writeln!(io.out, "{line}")?;
    }
    writeln!(io.out, "why          {}", verdict.why)?;
    Ok(EXIT_OK)
}

/// The recorded steps' names, in order.
fn step_names(r: &Record) -> String {
    let names: Vec<&str> = r.steps().iter().map(idemstore::Step::name).collect();
    names.join(", ")
}

/// The state machine's answer for this record and fingerprint (the stored
/// one when none is given), in words.
fn decide(
    existing: Option<&Record>,
    given: Option<&Given>,
    now: idemstore::Timestamp,
    hwm: u64,
) -> Result<Verdict, Failure> {
    let fingerprint = given
        .map(|g| g.fingerprint)
        .or_else(|| existing.map(Record::fingerprint).copied())
        .unwrap_or_else(|| Fingerprint::from_bytes([0; 32]));
    let step = logic::begin(
        existing.cloned(),
        &fingerprint,
        now,
        DEFAULT_LEASE,
        DEFAULT_RETENTION,
        || Ok(hwm + 1),
    )?;
    let same = if given.is_none() && existing.is_some() {
        " A request with a different fingerprint (another body, method, path or \
         fingerprinted header) would get CONFLICT (422)."
    } else {
        ""
    };
    Ok(match step.answer {
        Begin::Claimed(claim) => {
            let token = claim.token();
            let (name, why) = match existing {
                None => (
                    "claim",
                    format!(
                        "no record for this key: the request claims it (fencing token {token}) \
                         and the handler runs"
                    ),
                ),
                Some(r) if r.is_expired(now) => (
                    "claim",
                    format!(
                        "the record expired {} ago (retention over; invisible, not yet \
                         swept): it counts as absent, the request claims the key (token \
                         {token}) and the handler runs",
                        duration_ms(now.as_millis().saturating_sub(r.expires_at().as_millis()))
                    ),
                ),
                Some(r) if !claim.is_takeover() => (
                    "claim",
                    format!(
                        "the owner released the key and kept its recorded steps ({}): the \
                         request claims it (token {token}, attempt {}) and the handler runs, \
                         skipping those steps",
                        step_names(r),
                        claim.attempt()
                    ),
                ),
                Some(r) => (
                    "takeover",
                    format!(
                        "the record is PROCESSING and its owner's lease passed {} ago (the \
                         owner crashed or stalled): the request takes the claim over (token \
                         {token}, attempt {}) and the handler runs again{}; a guard with \
                         TakeoverPolicy::Reconcile answers 500 instead, for a check first",
                        duration_ms(
                            now.as_millis()
                                .saturating_sub(r.lease_until().map_or(0, |l| l.as_millis()))
                        ),
                        claim.attempt(),
                        if r.steps().is_empty() {
                            String::new()
                        } else {
                            format!(
                                ", skipping its recorded steps ({}); the step after them may \
                                 have started",
                                step_names(r)
                            )
                        }
                    ),
                ),
            };
            Verdict {
                name,
                http: None,
                why: format!("{why}.{same}"),
            }
        }
        Begin::Replay(response) => Verdict {
            name: "replay",
            http: Some(response.status()),
            why: format!(
                "the record is DONE with the same fingerprint: the stored response (status {}) \
                 is returned with Idempotent-Replayed: true, and the handler does not run.{same}",
                response.status()
            ),
        },
        Begin::InFlight { lease_until } => Verdict {
            name: "in_flight",
            http: Some(409),
            why: format!(
                "the record is PROCESSING: its owner (token {}) holds the lease until {}; the \
                 layer answers 409 with Retry-After, and after the lease a retry takes over.{same}",
                existing.map_or(0, Record::token),
                when(lease_until, now)
            ),
        },
        Begin::Conflict => Verdict {
            name: "conflict",
            http: Some(422),
            why: format!(
                "the key was first used with another fingerprint ({}; this request's differs): \
                 the request is refused with 422 and never gets the stored response{}",
                existing.map_or_else(String::new, |r| r.fingerprint().to_hex()),
                match existing.map(Record::state) {
                    Some(State::Processing) => " (the first request is still PROCESSING)",
                    _ => "",
                }
            ),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_group_by_name_in_order() {
        let args = vec![
            "X-Tenant: acme".to_owned(),
            "x-b:".to_owned(),
            "x-tenant: beta".to_owned(),
        ];
        let parsed = parse_headers(&args).expect("headers");
        assert_eq!(
            parsed,
            vec![
                (
                    "x-tenant".to_owned(),
                    vec!["acme".to_owned(), "beta".to_owned()]
                ),
                ("x-b".to_owned(), vec![]),
            ]
        );
        assert!(parse_headers(&["novalue".to_owned()]).is_err());
        assert!(parse_headers(&[": v".to_owned()]).is_err());
    }

    #[test]
    fn the_cli_fingerprint_is_the_layers() {
        let request = RequestArgs {
            kind: Kind::Http,
            method: Some("POST".into()),
            path: Some("/orders".into()),
            header: vec!["x-tenant: acme".into()],
            json_field: vec![],
            body: None,
        };
        let given = request.fingerprint().expect("fingerprint");
        assert_eq!(
            given.fingerprint,
            Fingerprint::of_http("POST", "/orders", b"", &[("x-tenant", &[b"acme"])])
        );
        let no_path = RequestArgs {
            path: None,
            ..request
        };
        assert!(no_path.fingerprint().is_err());
    }

    #[test]
    fn json_fields_are_the_layers_and_named_with_their_values() {
        let dir = std::env::temp_dir().join(format!("idemstore-explain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let body = dir.join("payment.json");
        std::fs::write(&body, br#"{"currency":"EUR","amount":1250,"ts":"x"}"#).expect("body");
        let request = RequestArgs {
            kind: Kind::Http,
            method: Some("POST".into()),
            path: Some("/payments".into()),
            header: vec![],
            json_field: vec!["/currency".into(), "/amount".into(), "/note".into()],
            body: Some(body.clone()),
        };
        let given = request.fingerprint().expect("fingerprint");
        let fields: Vec<JsonPointer> = ["/amount", "/currency", "/note"]
            .iter()
            .map(|p| JsonPointer::new(*p).expect("pointer"))
            .collect();
        let doc = serde_json::json!({"amount": 1250, "currency": "EUR"});
        assert_eq!(
            given.fingerprint,
            Fingerprint::of_http_json_fields("POST", "/payments", &doc, &fields, &[])
        );
        assert!(
            given
                .from
                .contains(r#"/amount = 1250, /currency = "EUR", /note absent"#),
            "{}",
            given.from
        );
        let json = RequestArgs {
            kind: Kind::Json,
            method: None,
            path: None,
            ..request
        };
        assert_eq!(
            json.fingerprint().expect("fingerprint").fingerprint,
            Fingerprint::of_json_fields(&doc, &fields)
        );
        for (kind, fields) in [(Kind::Bytes, vec!["/amount"]), (Kind::Json, vec!["amount"])] {
            let bad = RequestArgs {
                kind,
                method: None,
                path: None,
                header: vec![],
                json_field: fields.into_iter().map(String::from).collect(),
                body: Some(body.clone()),
            };
            let err = bad.fingerprint().expect_err("usage");
            assert_eq!(err.code, EXIT_USAGE);
        }
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
