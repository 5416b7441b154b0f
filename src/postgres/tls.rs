//! TLS to the server, as libpq sets it up: `sslmode`, `sslrootcert`,
//! `sslcert` and `sslkey` in the connection URL, with libpq's meanings,
//! through rustls.
//!
//! tokio-postgres parses the URL but knows only `disable`, `prefer` and
//! `require`, and no certificate files, so [`split`] takes these four
//! options out of the URL first and hands tokio-postgres the rest.
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default) | if the server offers it | not checked |
//! | `require` | always | not checked; checked against `sslrootcert` as `verify-ca` when one is given |
//! | `verify-ca` | always | signed by `sslrootcert`, or by the platform's roots when none is given |
//! | `verify-full` | always | as `verify-ca`, and issued for the host connected to |

use crate::error::{Error, Result};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

/// `sslmode`, from least to most checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS options a URL carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Tls {
    pub(super) mode: Mode,
    root_cert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

/// How the pool opens a connection.
#[derive(Clone)]
pub(super) enum Connector {
    Plain,
    Tls(MakeRustlsConnect),
}

/// Takes the TLS options out of `url` (either form libpq accepts):
/// returns the rest, for tokio-postgres, and the options.
pub(super) fn split(url: &str) -> Result<(String, Tls)> {
    let mut tls = Tls {
        mode: Mode::Prefer,
        root_cert: None,
        cert: None,
        key: None,
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((head, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&') {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    if !tls.take(&percent_decode(k)?, &percent_decode(v)?)? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    head.to_owned()
                } else {
                    format!("{head}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut rest = String::new();
        for pair in key_value_pairs(url)? {
            if !tls.take(&pair.key, &pair.value)? {
                rest.push_str(pair.text);
                rest.push(' ');
            }
        }
        rest.trim_end().to_owned()
    };
    if tls.mode == Mode::Require && tls.root_cert.is_some() {
        tls.mode = Mode::VerifyCa; // as libpq does
    }
    if tls.cert.is_some() != tls.key.is_some() {
        return Err(Error::invalid_argument(
            "sslcert and sslkey go together: a client certificate needs its key",
        ));
    }
    if tls.mode == Mode::Disable && (tls.root_cert.is_some() || tls.cert.is_some()) {
        return Err(Error::invalid_argument(
            "sslmode=disable with certificate files: remove them or choose another sslmode",
        ));
    }
    Ok((rest, tls))
}

impl Tls {
    /// Takes `key` if it is a TLS option; `false` for any other key.
    fn take(&mut self, key: &str, value: &str) -> Result<bool> {
        let path = || {
            if value.is_empty() {
                Err(Error::invalid_argument(format!("{key} is empty")))
            } else {
                Ok(Some(PathBuf::from(value)))
            }
        };
        match key {
            "sslmode" => {
                self.mode = match value {
                    "disable" => Mode::Disable,
                    "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-ca" => Mode::VerifyCa,
                    "verify-full" => Mode::VerifyFull,
                    "allow" => {
                        return Err(Error::invalid_argument(
                            "sslmode=allow is not supported: use prefer (TLS when the server offers it)",
                        ));
                    }
                    other => {
                        return Err(Error::invalid_argument(format!(
                            "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
                        )));
                    }
                }
            }
            "sslrootcert" => self.root_cert = path()?,
            "sslcert" => self.cert = path()?,
            "sslkey" => self.key = path()?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The `sslmode` tokio-postgres negotiates with.
    pub(super) fn wire_mode(&self) -> SslMode {
        match self.mode {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }

    /// Reads the certificate files and builds the connector: every file
    /// problem is an error here, at build, not at the first connection.
    pub(super) fn connector(&self) -> Result<Connector> {
        if self.mode == Mode::Disable {
            return Ok(Connector::Plain);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid_argument(format!("TLS: {e}")))?;
        let chain = match self.mode {
            Mode::Disable | Mode::Prefer | Mode::Require => None,
            Mode::VerifyCa | Mode::VerifyFull => Some(
                WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.roots()?),
                    Arc::clone(&provider),
                )
                .build()
                .map_err(|e| Error::invalid_argument(format!("TLS roots: {e}")))?,
            ),
        };
        let builder = match chain {
            Some(chain) if self.mode == Mode::VerifyFull => builder.with_webpki_verifier(chain),
            chain => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Lenient { provider, chain })),
        };
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs("sslcert", cert)?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    Error::invalid_argument(format!("sslkey {}: {e}", key.display()))
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| Error::invalid_argument(format!("sslcert and sslkey: {e}")))?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(Connector::Tls(MakeRustlsConnect::new(config)))
    }

    /// The CAs a `verify-*` connection trusts: `sslrootcert`'s, else the
    /// platform's.
    fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        if let Some(path) = &self.root_cert {
            for cert in read_certs("sslrootcert", path)? {
                roots.add(cert).map_err(|e| {
                    Error::invalid_argument(format!("sslrootcert {}: {e}", path.display()))
                })?;
            }
            return Ok(roots);
        }
        let native = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(native.certs);
        if added == 0 {
            let why: Vec<String> = native.errors.iter().map(ToString::to_string).collect();
            return Err(Error::invalid_argument(format!(
                "no sslrootcert given and no platform CA certificate could be loaded ({})",
                if why.is_empty() {
                    "none found".to_owned()
                } else {
                    why.join("; ")
                }
            )));
        }
        Ok(roots)
    }
}

fn read_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |e: &dyn std::fmt::Display| {
        Error::invalid_argument(format!("{what} {}: {e}", path.display()))
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(&e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    if certs.is_empty() {
        return Err(bad(&"no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The server's certificate as `prefer`, `require` and `verify-ca` check
/// it. Without a chain verifier (`prefer`, `require`) the connection is
/// encrypted and the server not authenticated, as libpq does. With one
/// (`verify-ca`) the chain must lead to a trusted root and the name is not
/// checked: webpki checks the chain before the name, so a name error means
/// the chain verified. Either way the handshake's signatures are checked,
/// so the session keys belong to whoever holds the certificate.
#[derive(Debug)]
struct Lenient {
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<WebPkiServerVerifier>>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// One `key=value` of libpq's keyword form: the key, the unquoted value,
/// and the pair's text as written (to hand on unchanged).
struct Pair<'a> {
    key: String,
    value: String,
    text: &'a str,
}

/// libpq's keyword form: `key=value` pairs separated by spaces, a value
/// in single quotes when it holds spaces, `\'` and `\\` escaped in it.
fn key_value_pairs(s: &str) -> Result<Vec<Pair<'_>>> {
    let bad = || {
        Error::invalid_argument("not a PostgreSQL connection string: a key=value pair is cut short")
    };
    let bytes = s.as_bytes();
    let mut pairs = Vec::new();
    let mut i = 0;
    loop {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        if i >= bytes.len() {
            return Ok(pairs);
        }
        let start = i;
        while bytes
            .get(i)
            .is_some_and(|b| *b != b'=' && !b.is_ascii_whitespace())
        {
            i += 1;
        }
        let key = s.get(start..i).ok_or_else(bad)?.to_owned();
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        if bytes.get(i) != Some(&b'=') {
            return Err(bad());
        }
        i += 1;
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        let mut value = Vec::new();
        if bytes.get(i) == Some(&b'\'') {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => return Err(bad()),
                    Some(b'\'') => break,
                    Some(b'\\') => {
                        value.push(*bytes.get(i + 1).ok_or_else(bad)?);
                        i += 2;
                    }
                    Some(&b) => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
            i += 1;
        } else {
            while let Some(&b) = bytes.get(i).filter(|b| !b.is_ascii_whitespace()) {
                value.push(b);
                i += 1;
            }
        }
        pairs.push(Pair {
            key,
            value: String::from_utf8(value).map_err(|_| bad())?,
            text: s.get(start..i).ok_or_else(bad)?,
        });
    }
}

fn percent_decode(s: &str) -> Result<String> {
    let bad = || Error::invalid_argument("not a PostgreSQL connection URL: bad percent-encoding");
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next().ok_or_else(bad)?, bytes.next().ok_or_else(bad)?];
            let hex = std::str::from_utf8(&hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(mode: Mode, root: Option<&str>, cert: Option<&str>, key: Option<&str>) -> Tls {
        Tls {
            mode,
            root_cert: root.map(PathBuf::from),
            cert: cert.map(PathBuf::from),
            key: key.map(PathBuf::from),
        }
    }

    #[test]
    fn a_url_keeps_every_other_option_and_gives_up_the_tls_ones() {
        let (rest, got) = split(
            "postgres://u:p@h1:5432,h2/db?application_name=a&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.crt&target_session_attrs=read-write",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p@h1:5432,h2/db?application_name=a&target_session_attrs=read-write"
        );
        assert_eq!(got, tls(Mode::VerifyFull, Some("/tmp/ca.crt"), None, None));

        let (rest, got) = split("postgresql://h/db?sslmode=disable").unwrap();
        assert_eq!(
            (rest.as_str(), got.mode),
            ("postgresql://h/db", Mode::Disable)
        );
        let (rest, got) = split("postgres://h/db").unwrap();
        assert_eq!((rest.as_str(), got.mode), ("postgres://h/db", Mode::Prefer));
    }

    #[test]
    fn the_keyword_form_keeps_quoted_values_as_written() {
        let (rest, got) = split(
            "host=h  password='a b\\'c' sslmode = verify-ca sslrootcert='/my certs/ca.pem' sslcert=/c sslkey=/k dbname=d",
        )
        .unwrap();
        assert_eq!(rest, "host=h password='a b\\'c' dbname=d");
        assert_eq!(
            got,
            tls(
                Mode::VerifyCa,
                Some("/my certs/ca.pem"),
                Some("/c"),
                Some("/k")
            )
        );
        assert!(split("host=h password='open").is_err());
        assert!(split("host").is_err());
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain_as_libpq_does() {
        let (_, got) = split("postgres://h/db?sslmode=require&sslrootcert=/ca").unwrap();
        assert_eq!(got.mode, Mode::VerifyCa);
        assert_eq!(got.wire_mode(), SslMode::Require);
        let (_, got) = split("postgres://h/db?sslmode=require").unwrap();
        assert_eq!(got.mode, Mode::Require);
    }

    #[test]
    fn bad_tls_options_are_refused_by_name_without_the_url() {
        for (url, says) in [
            (
                "postgres://u:secret@h/db?sslmode=allow",
                "sslmode=allow is not supported",
            ),
            (
                "postgres://u:secret@h/db?sslmode=verify",
                "sslmode=verify is not one of",
            ),
            (
                "postgres://u:secret@h/db?sslcert=/c",
                "sslcert and sslkey go together",
            ),
            (
                "postgres://u:secret@h/db?sslkey=/k",
                "sslcert and sslkey go together",
            ),
            (
                "postgres://u:secret@h/db?sslrootcert=",
                "sslrootcert is empty",
            ),
            (
                "postgres://u:secret@h/db?sslmode=disable&sslrootcert=/ca",
                "sslmode=disable with certificate files",
            ),
            (
                "postgres://u:secret@h/db?sslmode=%zz",
                "bad percent-encoding",
            ),
            ("user=u password=secret sslmode=bogus", "sslmode=bogus"),
        ] {
            let err = split(url).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{url}: {err}");
            assert!(err.to_string().contains(says), "{url}: {err}");
            assert!(!err.to_string().contains("secret"), "{url}: {err}");
        }
    }

    #[test]
    fn a_missing_or_empty_certificate_file_is_an_error_at_build_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, b"").unwrap();
        let missing = dir.path().join("missing.pem");
        for (opts, says) in [
            (
                tls(Mode::VerifyFull, missing.to_str(), None, None),
                "missing.pem",
            ),
            (
                tls(Mode::VerifyCa, empty.to_str(), None, None),
                "no PEM certificate",
            ),
            (
                tls(Mode::Require, None, missing.to_str(), empty.to_str()),
                "sslcert",
            ),
        ] {
            let Err(err) = opts.connector() else {
                panic!("{opts:?} built a connector")
            };
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
            assert!(err.to_string().contains(says), "{err}");
        }
        assert!(matches!(
            tls(Mode::Disable, None, None, None).connector(),
            Ok(Connector::Plain)
        ));
        assert!(matches!(
            tls(Mode::Prefer, None, None, None).connector(),
            Ok(Connector::Tls(_))
        ));
    }
}
