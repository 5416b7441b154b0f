//! A simulated order service under a retry storm.
//!
//! Every order is one intent with one `Idempotency-Key`. Clients double-click,
//! time out and retry, gateways retry, a few clients reuse a key with other
//! parameters, and once the store fails to record a completion. The payment
//! ledger counts every charge; at the end every order must be charged
//! exactly once.
//!
//! ```text
//! cargo run --release --example retry_storm
//! ```

use idemstore::{FaultyStore, Fingerprint, Guard, Key, MemoryStore, Op, Outcome, Response, Store};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ORDERS: u64 = 400;
const CLIENT_THREADS: u64 = 16;
const LEASE: Duration = Duration::from_millis(300);
const HANDLER_TIME: Duration = Duration::from_millis(15);

/// The payment provider: charges are keyed by order, and the provider itself
/// refuses a second charge for the same order (the downstream idempotency key
/// that absorbs a handler that ran twice).
#[derive(Default)]
struct Payments {
    charges: Mutex<BTreeMap<u64, u64>>,
    attempts: AtomicU64,
}

impl Payments {
    fn charge(&self, order: u64, cents: u64) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.charges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(order)
            .or_insert(cents);
    }
}

#[derive(Default)]
struct Tally {
    by_outcome: Mutex<BTreeMap<&'static str, u64>>,
    requests: AtomicU64,
}

impl Tally {
    fn add(&self, outcome: &Outcome<Infallible>) {
        let name = match outcome {
            Outcome::Executed(_) => "executed",
            Outcome::Replayed(_) => "replayed",
            Outcome::InFlight { .. } => "in flight (409)",
            Outcome::Conflicted => "conflicted (422)",
            Outcome::Unavailable(_) => "unavailable (503)",
            Outcome::NotStored { .. } => "executed, not stored",
            _ => "other",
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        *self
            .by_outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name)
            .or_default() += 1;
    }
}

struct Service<S> {
    guard: Guard<Arc<FaultyStore<S>>>,
    payments: Payments,
    tally: Tally,
    handler_runs: AtomicU64,
}

impl<S: Store> Service<S> {
    fn order(&self, order: u64, qty: u64) -> Outcome<Infallible> {
        let key = Key::new("shop-1", format!("order-{order}")).expect("ids are short");
        let fp = Fingerprint::of_parts([b"POST /orders".as_slice(), &qty.to_be_bytes()]);
        let out = self.guard.run(&key, &fp, |claim| {
            self.handler_runs.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(HANDLER_TIME);
            self.payments.charge(order, 1000 * qty);
            Ok(Response::new(
                201,
                format!("order {order} paid, token {}", claim.token()),
            ))
        });
        self.tally.add(&out);
        out
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let service = Arc::new(Service {
        guard: Guard::builder(Arc::clone(&store)).lease(LEASE).build()?,
        payments: Payments::default(),
        tally: Tally::default(),
        handler_runs: AtomicU64::new(0),
    });
    println!("retry storm: {ORDERS} orders, {CLIENT_THREADS} client threads, store: MemoryStore");

    // Phase 1: the storm. Each client thread owns a slice of the orders and
    // sends each one the way real clients do.
    let threads: Vec<_> = (0..CLIENT_THREADS)
        .map(|t| {
            let service = Arc::clone(&service);
            std::thread::spawn(move || {
                for order in (t..ORDERS).step_by(CLIENT_THREADS as usize) {
                    match order % 4 {
                        // Double click: two identical requests at once.
                        0 => {
                            let s2 = Arc::clone(&service);
                            let twin = std::thread::spawn(move || s2.order(order, 1));
                            service.order(order, 1);
                            let _ = twin.join();
                        }
                        // Client timeout: the client gives up after 5 ms and
                        // retries while the first request still runs.
                        1 => {
                            let s2 = Arc::clone(&service);
                            let first = std::thread::spawn(move || s2.order(order, 1));
                            std::thread::sleep(Duration::from_millis(5));
                            service.order(order, 1);
                            let _ = first.join();
                            service.order(order, 1); // and once more after it finished
                        }
                        // Gateway retries: three more sends after the first answer.
                        2 => {
                            for _ in 0..4 {
                                service.order(order, 1);
                            }
                        }
                        // A buggy client reuses the key with another quantity.
                        _ => {
                            service.order(order, 1);
                            service.order(order, 2);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "client thread panicked")?;
    }

    // Phase 2: the store fails to record one completion. The retry inside
    // the lease is refused; after the lease it takes over and runs again,
    // and the payment provider absorbs the second charge.
    let failed_order = ORDERS;
    store.fail_next(Op::Complete, 1);
    let first = service.order(failed_order, 1);
    assert!(matches!(first, Outcome::NotStored { .. }), "{first:?}");
    let inside = service.order(failed_order, 1);
    assert!(matches!(inside, Outcome::InFlight { .. }), "{inside:?}");
    std::thread::sleep(LEASE + Duration::from_millis(20));
    let after = service.order(failed_order, 1);
    assert!(matches!(after, Outcome::Executed(_)), "{after:?}");
    let replay = service.order(failed_order, 1);
    assert!(matches!(replay, Outcome::Replayed(_)), "{replay:?}");

    // Phase 3: the store goes down: every request fails closed.
    store.fail_all();
    let down = service.order(ORDERS + 1, 1);
    assert!(matches!(down, Outcome::Unavailable(_)), "{down:?}");
    store.clear_fault();

    print_report(&service, started.elapsed())?;
    Ok(())
}

fn print_report<S: Store>(
    service: &Service<S>,
    elapsed: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    println!();
    println!("{:<24} {:>8}", "outcome", "requests");
    for (name, n) in service
        .tally
        .by_outcome
        .lock()
        .map_err(|_| "poisoned")?
        .iter()
    {
        println!("{name:<24} {n:>8}");
    }
    println!(
        "{:<24} {:>8}",
        "total",
        service.tally.requests.load(Ordering::Relaxed)
    );

    let charges = service.payments.charges.lock().map_err(|_| "poisoned")?;
    let orders_paid = charges.len() as u64;
    let total_cents: u64 = charges.values().sum();
    println!();
    println!("ledger");
    println!("  orders placed            {:>8}", ORDERS + 1);
    println!("  orders charged           {orders_paid:>8}");
    println!(
        "  charge attempts          {:>8}",
        service.payments.attempts.load(Ordering::Relaxed)
    );
    println!(
        "  handler runs             {:>8}",
        service.handler_runs.load(Ordering::Relaxed)
    );
    println!(
        "  total charged            {:>8.2} EUR",
        total_cents as f64 / 100.0
    );
    let stats = service.guard.stats();
    println!("  takeovers                {:>8}", stats.takeovers);
    println!("  elapsed                  {:>8.2?}", elapsed);

    // Every placed order is charged exactly once, for quantity 1; the one
    // handler that ran twice (the failed completion) was absorbed downstream.
    let every_order_once = orders_paid == ORDERS + 1 && charges.values().all(|c| *c == 1000);
    let runs = service.handler_runs.load(Ordering::Relaxed);
    let one_run_per_order_plus_takeover = runs == ORDERS + 2;
    println!();
    if every_order_once && one_run_per_order_plus_takeover {
        println!(
            "OK: every order charged exactly once ({runs} handler runs = {} orders + 1 takeover)",
            ORDERS + 1
        );
        Ok(())
    } else {
        Err(format!("ledger mismatch: {orders_paid} orders charged, {runs} handler runs").into())
    }
}
