//! TLS to PostgreSQL: `sslmode` and the certificate options of the URL,
//! against the test cluster's throwaway CA (`scripts/pg-test-cluster`,
//! which serves TLS and exports `IDEMSTORE_PG_TLS_DIR`). Its role `tlsonly`
//! is refused without TLS, so a store that works as `tlsonly` proved the
//! connection encrypted; `certuser` logs in with its client certificate only.

use crate::postgres::{DropTable, enabled, fresh_table, pg_url};
use idemstore::{Error, Fingerprint, Guard, Key, Outcome, PostgresStore, Response};
use std::path::PathBuf;
use std::time::Duration;

fn tls_dir() -> PathBuf {
    PathBuf::from(std::env::var("IDEMSTORE_PG_TLS_DIR").expect(
        "IDEMSTORE_PG_TLS_DIR: start the server with scripts/pg-test-cluster, which makes the certificates",
    ))
}

/// The test server's port, from its URL.
fn port() -> u16 {
    let url = pg_url().expect("checked by the caller");
    let after_host = url.rsplit_once(':').expect("host:port").1;
    after_host.split('/').next().unwrap().parse().unwrap()
}

/// A URL to the test server as `user` at `host`, with `options`.
fn url(user: &str, host: &str, options: &str) -> String {
    format!("postgres://{user}@{host}:{}/idemstore?{options}", port())
}

fn file(name: &str) -> String {
    tls_dir().join(name).display().to_string()
}

fn open(url: &str) -> Result<(PostgresStore, DropTable), Error> {
    let table = fresh_table("tls");
    let store = PostgresStore::builder()
        .table(&table)
        .max_size(2)
        .connect_timeout(Duration::from_secs(30))
        .build_timeout(Duration::from_secs(60))
        .migrate_on_build(true)
        .connect(url)?;
    let drop = DropTable {
        url: pg_url().expect("checked by the caller"),
        table,
    };
    Ok((store, drop))
}

/// The store answers through the connection: a run, then its replay.
fn runs_and_replays(store: PostgresStore) {
    let guard = Guard::new(store);
    let key = Key::new("tls", "order-1").unwrap();
    let fp = Fingerprint::of(b"qty=1");
    let handler = |_: &idemstore::Claim| Ok::<_, std::io::Error>(Response::new(201, "made"));
    assert!(matches!(
        guard.run(&key, &fp, handler),
        Outcome::Executed(_)
    ));
    assert!(matches!(guard.run(&key, &fp, handler), Outcome::Replayed(r) if r.body() == b"made"));
}

fn refused(url: &str, says: &str) {
    let Err(err) = open(url) else {
        panic!("{url} connected")
    };
    assert!(matches!(err, Error::Backend(_)), "{err}");
    let text = format!("{err}");
    assert!(text.contains(says), "{url}: {text}");
}

#[test]
fn verify_full_connects_with_the_right_ca_and_host_name() {
    if !enabled() {
        return;
    }
    let ca = file("ca.crt");
    let (store, _drop) = open(&url(
        "tlsonly",
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .unwrap();
    runs_and_replays(store);
}

#[test]
fn verify_full_refuses_a_host_name_the_certificate_does_not_name() {
    if !enabled() {
        return;
    }
    let ca = file("ca.crt");
    // The server's certificate names localhost only.
    refused(
        &url(
            "tlsonly",
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        "not valid for name",
    );
}

#[test]
fn verify_ca_checks_the_chain_but_not_the_name() {
    if !enabled() {
        return;
    }
    let (store, _drop) = open(&url(
        "tlsonly",
        "127.0.0.1",
        &format!("sslmode=verify-ca&sslrootcert={}", file("ca.crt")),
    ))
    .unwrap();
    runs_and_replays(store);
    refused(
        &url(
            "tlsonly",
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={}", file("other-ca.crt")),
        ),
        "UnknownIssuer",
    );
}

#[test]
fn a_certificate_from_an_untrusted_ca_is_refused() {
    if !enabled() {
        return;
    }
    refused(
        &url(
            "tlsonly",
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", file("other-ca.crt")),
        ),
        "UnknownIssuer",
    );
    // require with a CA file verifies the chain, as libpq does.
    refused(
        &url(
            "tlsonly",
            "localhost",
            &format!("sslmode=require&sslrootcert={}", file("other-ca.crt")),
        ),
        "UnknownIssuer",
    );
}

#[test]
fn prefer_and_require_encrypt_without_checking_the_certificate() {
    if !enabled() {
        return;
    }
    for options in [
        "sslmode=require",
        "sslmode=prefer",
        "application_name=default-is-prefer",
    ] {
        let (store, _drop) = open(&url("tlsonly", "127.0.0.1", options)).unwrap();
        runs_and_replays(store);
    }
}

#[test]
fn a_tls_only_server_refuses_a_plaintext_client() {
    if !enabled() {
        return;
    }
    refused(
        &url("tlsonly", "127.0.0.1", "sslmode=disable"),
        "no encryption",
    );
}

#[test]
fn a_client_certificate_logs_in_where_the_server_asks_for_one() {
    if !enabled() {
        return;
    }
    let (store, _drop) = open(&url(
        "certuser",
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            file("ca.crt"),
            file("client.crt"),
            file("client.key")
        ),
    ))
    .unwrap();
    runs_and_replays(store);
    refused(
        &url(
            "certuser",
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", file("ca.crt")),
        ),
        "certificate",
    );
}
