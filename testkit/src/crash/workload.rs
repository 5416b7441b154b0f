//! A workload of begin/complete/release/record_step/sweep on the real `RedbStore` over a
//! [`CrashBackend`], and what each operation's answer says must survive.
//!
//! Each thread owns its keys, so a key's operations form one sequence and
//! at most one of them is in flight at any instant; sweeps (any thread) are
//! the only cross-key writes, and they only delete expired records. Every
//! answer is logged with the backend's mutation count when it returned:
//! an image taken at a later count must hold it.
//!
//! The threads share one clock, and each step reads it when it starts: a
//! sweep on another thread may run at a later time than a step in flight,
//! and delete a record that step still sees as unexpired ([`Clock`]).

use super::backend::CrashBackend;
use super::rng::Rng;
use idemstore::Error;
use idemstore::Fingerprint;
use idemstore::Key;
use idemstore::RedbStore;
use idemstore::Response;
use idemstore::Store;
use idemstore::Timestamp;
use idemstore::{Begin, Claim, State};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Lease of every claim in the workload.
pub const LEASE: Duration = Duration::from_millis(2_000);
/// Retention of one key in three: it expires within a run, so sweeps and
/// fresh claims over expired records happen.
pub const SHORT_RETENTION: Duration = Duration::from_millis(2_000);
/// Retention of the other keys.
pub const LONG_RETENTION: Duration = Duration::from_secs(3_600);
/// The workload's start time: 2026-10-19T04:00:00Z.
pub const T0: Timestamp = Timestamp::from_millis(1_760_846_400_000);
/// Most keys one thread owns (key selectors are taken modulo this).
pub const MAX_KEYS_PER_THREAD: u8 = 8;

/// One step of a thread's workload. Selectors are reduced modulo the
/// thread's key count, so any value is a valid step (the fuzzer's too).
#[derive(Clone, Debug, arbitrary::Arbitrary)]
pub enum Step {
    /// `begin` with fingerprint `fp % 2` (1 is a conflicting request).
    Begin {
        /// Key selector.
        key: u8,
        /// Fingerprint selector.
        fp: u8,
    },
    /// `complete` with the key's newest claim (its oldest when `stale`).
    Complete {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
        /// Body length (`len % 20_000` bytes, so some span several pages).
        len: u16,
        /// Body byte and status selector.
        byte: u8,
    },
    /// `record_step` of step `s{name % 4}` (output `[byte]`) with the
    /// newest (or oldest) claim.
    Record {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
        /// Step name selector.
        name: u8,
        /// The output byte.
        byte: u8,
    },
    /// `release` with the newest (or oldest) claim.
    Release {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
    },
    /// `sweep_expired(now, 1 + max % 8)`.
    Sweep {
        /// Batch size selector.
        max: u8,
    },
    /// Moves the shared clock forward `ms % 500` milliseconds.
    Advance {
        /// Milliseconds.
        ms: u16,
    },
}

impl Step {
    /// A seeded step: mostly claims and completions, on purpose with stale
    /// claims, conflicts, releases and sweeps among them.
    pub fn random(rng: &mut Rng) -> Step {
        let key = u8::try_from(rng.below(u64::from(MAX_KEYS_PER_THREAD))).unwrap_or(0);
        match rng.below(100) {
            0..35 => Step::Begin {
                key,
                fp: u8::from(rng.chance(10)),
            },
            35..45 => Step::Record {
                key,
                stale: rng.chance(15),
                name: u8::try_from(rng.below(4)).unwrap_or(0),
                byte: u8::try_from(rng.below(256)).unwrap_or(0),
            },
            45..65 => Step::Complete {
                key,
                stale: rng.chance(15),
                len: u16::try_from(if rng.chance(10) {
                    rng.below(20_000)
                } else {
                    rng.below(600)
                })
                .unwrap_or(0),
                byte: u8::try_from(rng.below(256)).unwrap_or(0),
            },
            65..75 => Step::Release {
                key,
                stale: rng.chance(30),
            },
            75..82 => Step::Sweep {
                max: u8::try_from(rng.below(8)).unwrap_or(0),
            },
            _ => Step::Advance {
                ms: u16::try_from(rng.below(500)).unwrap_or(0),
            },
        }
    }
}

/// What a key holds after an operation, as its answer says.
#[derive(Clone, PartialEq)]
pub(super) enum Slot {
    /// No record (never claimed, or released).
    Absent,
    /// A record with these fields.
    Live {
        fp: Fingerprint,
        state: State,
        token: u64,
        lease_until: Option<Timestamp>,
        expires_at: Timestamp,
        attempts: u32,
        response: Option<Response>,
        steps: Vec<idemstore::Step>,
        /// The `now` of the operation that wrote it (inside its lease and
        /// before its expiry).
        written_at: Timestamp,
    },
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Slot::Absent => f.write_str("absent"),
            Slot::Live {
                state,
                token,
                lease_until,
                expires_at,
                response,
                steps,
                ..
            } => write!(
                f,
                "{state} token {token} lease {lease_until:?} expires {expires_at:?} body {:?} bytes, {} steps",
                response.as_ref().map(|r| r.body().len()),
                steps.len()
            ),
        }
    }
}

/// A record, as briefly as [`Slot`]'s `Debug`.
pub(super) fn describe(r: Option<&idemstore::Record>) -> String {
    match r {
        None => "absent".into(),
        Some(r) => format!(
            "{} token {} lease {:?} expires {:?} body {:?} bytes, {} steps",
            r.state(),
            r.token(),
            r.lease_until(),
            r.expires_at(),
            r.response().map(|x| x.body().len()),
            r.steps().len()
        ),
    }
}

impl Slot {
    pub(super) fn matches(&self, found: Option<&idemstore::Record>) -> bool {
        match (self, found) {
            (Slot::Absent, None) => true,
            (
                Slot::Live {
                    fp,
                    state,
                    token,
                    lease_until,
                    expires_at,
                    attempts,
                    response,
                    steps,
                    written_at: _,
                },
                Some(r),
            ) => {
                *r.fingerprint() == *fp
                    && r.state() == *state
                    && r.token() == *token
                    && r.lease_until() == *lease_until
                    && r.expires_at() == *expires_at
                    && r.attempts() == *attempts
                    && r.response() == response.as_ref()
                    && r.steps() == steps.as_slice()
            }
            _ => false,
        }
    }

    pub(super) fn expires_at(&self) -> Option<Timestamp> {
        match self {
            Slot::Absent => None,
            Slot::Live { expires_at, .. } => Some(*expires_at),
        }
    }
}

/// One operation on a key and what it left.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    /// Backend mutations when the answer came back.
    pub(super) acked_at: u64,
    /// The key's slot after it.
    pub(super) after: Slot,
}

/// One key's operations, in order; the first entry is the empty start.
#[derive(Clone, Debug)]
pub(super) struct KeyLog {
    pub(super) key: Key,
    pub(super) retention: Duration,
    pub(super) history: Vec<Entry>,
}

/// Everything a run acknowledged.
#[derive(Clone, Debug, Default)]
pub(super) struct RunLog {
    pub(super) keys: Vec<KeyLog>,
    /// `(backend mutations when the sweep started, its now)`.
    pub(super) sweeps: Vec<(u64, Timestamp)>,
    /// `(acked_at, token)` of every claim handed out.
    pub(super) claims: Vec<(u64, u64)>,
    /// Claims over a record a later sweep deleted ([`Clock`]).
    pub(super) swept_in_flight: u64,
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint::of([b'f', fp % 2])
}

fn response(len: u16, byte: u8) -> Response {
    Response::new(
        200 + u16::from(byte % 4),
        vec![byte; usize::from(len) % 20_000],
    )
    .with_header("x-byte", [byte])
}

/// The workload's clock, shared by its threads.
pub(super) struct Clock {
    /// Milliseconds since the Unix epoch.
    now: AtomicU64,
    /// The latest `now` any sweep has started with: a record that expires
    /// by then may be gone, whatever the reading step's own `now` says.
    swept_until: AtomicU64,
    /// How long a step on a key waits between reading the clock and its
    /// call.
    step_delay: Duration,
}

impl Clock {
    /// A clock at [`T0`] that no sweep has run on.
    pub(super) fn new(step_delay: Duration) -> Clock {
        Clock {
            now: AtomicU64::new(T0.as_millis()),
            swept_until: AtomicU64::new(0),
            step_delay,
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now.load(Ordering::SeqCst))
    }

    fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }

    /// Records a sweep at `now`, before it can delete anything.
    fn sweeping(&self, now: Timestamp) {
        self.swept_until
            .fetch_max(now.as_millis(), Ordering::SeqCst);
    }

    /// Waits `step_delay` (a step on a key, after reading the clock; a
    /// zero sleep makes no system call).
    fn delay(&self) {
        std::thread::sleep(self.step_delay);
    }

    /// Whether a sweep has started at or after `expires_at`.
    fn may_have_swept(&self, expires_at: Timestamp) -> bool {
        self.swept_until.load(Ordering::SeqCst) >= expires_at.as_millis()
    }
}

/// Runs `steps` as thread `thread` on its own `keys` keys.
pub(super) fn run_thread(
    store: &RedbStore,
    backend: &CrashBackend,
    clock: &Clock,
    thread: usize,
    keys: u8,
    steps: impl IntoIterator<Item = Step>,
) -> Result<RunLog, String> {
    let keys = keys.clamp(1, MAX_KEYS_PER_THREAD);
    let mut log = RunLog::default();
    for i in 0..keys {
        let key = Key::new("crash", format!("t{thread}-k{i}")).map_err(|e| e.to_string())?;
        let retention = if i % 3 == 0 {
            SHORT_RETENTION
        } else {
            LONG_RETENTION
        };
        log.keys.push(KeyLog {
            key,
            retention,
            history: vec![Entry {
                acked_at: 0,
                after: Slot::Absent,
            }],
        });
    }
    let mut claims: Vec<Vec<Claim>> = vec![Vec::new(); usize::from(keys)];
    for (n, step) in steps.into_iter().enumerate() {
        let now = clock.now();
        let fail = |e: &dyn std::fmt::Debug| format!("thread {thread} step {n} {step:?}: {e:?}");
        let k = match step {
            Step::Begin { key, .. }
            | Step::Complete { key, .. }
            | Step::Record { key, .. }
            | Step::Release { key, .. } => usize::from(key % keys),
            Step::Sweep { max } => {
                let started = backend.mutations();
                log.sweeps.push((started, now));
                clock.sweeping(now);
                store
                    .sweep_expired(now, 1 + usize::from(max % 8))
                    .map_err(|e| fail(&e))?;
                continue;
            }
            Step::Advance { ms } => {
                clock.advance(u64::from(ms % 500));
                continue;
            }
        };
        let (Some(kl), Some(held)) = (log.keys.get_mut(k), claims.get_mut(k)) else {
            continue;
        };
        clock.delay();
        let before = kl.history.last().map_or(Slot::Absent, |e| e.after.clone());
        let after = match step {
            Step::Begin { fp, .. } => {
                let fp = fingerprint(fp);
                match store.begin(&kl.key, &fp, now, LEASE, kl.retention) {
                    Ok(Begin::Claimed(c)) => {
                        // A fresh claim (no takeover, no kept steps) over
                        // an unexpired record a sweep at a later time may
                        // have deleted: it was deleted.
                        let before = match before {
                            Slot::Live { expires_at, .. }
                                if expires_at > now
                                    && !c.is_takeover()
                                    && c.steps().is_empty()
                                    && clock.may_have_swept(expires_at) =>
                            {
                                log.swept_in_flight += 1;
                                Slot::Absent
                            }
                            before => before,
                        };
                        // A live record is taken over, or claimed again
                        // after a release that kept its steps: its
                        // expiry stays (never before the new lease).
                        let expires_at = match &before {
                            Slot::Live { expires_at, .. } if *expires_at > now => {
                                (*expires_at).max(now + LEASE)
                            }
                            _ if c.is_takeover() => return Err(fail(&"takeover of nothing")),
                            _ => now + kl.retention,
                        };
                        let steps = match &before {
                            Slot::Live {
                                steps,
                                expires_at,
                                state: State::Processing,
                                ..
                            } if *expires_at > now => steps.clone(),
                            _ => Vec::new(),
                        };
                        if c.steps() != steps.as_slice() {
                            return Err(fail(&format!(
                                "claimed with steps {:?}, the log has {steps:?}",
                                c.steps()
                            )));
                        }
                        log.claims.push((backend.mutations(), c.token()));
                        held.push(c.clone());
                        Slot::Live {
                            fp,
                            state: State::Processing,
                            token: c.token(),
                            lease_until: Some(c.lease_until()),
                            expires_at,
                            attempts: c.attempt(),
                            response: None,
                            steps,
                            written_at: now,
                        }
                    }
                    Ok(_) => continue,
                    Err(e) => return Err(fail(&e)),
                }
            }
            Step::Complete {
                stale, len, byte, ..
            } => {
                let Some(c) = (if stale { held.first() } else { held.last() }).cloned() else {
                    continue;
                };
                let r = response(len, byte);
                match store.complete(&kl.key, &c, &r, now, kl.retention) {
                    Ok(()) => match before {
                        Slot::Live {
                            fp,
                            token,
                            attempts,
                            ..
                        } if token == c.token() => Slot::Live {
                            fp,
                            state: State::Done,
                            token,
                            lease_until: None,
                            expires_at: now + kl.retention,
                            attempts,
                            response: Some(r),
                            steps: Vec::new(),
                            written_at: now,
                        },
                        _ => return Err(fail(&"completed a claim the log says is stale")),
                    },
                    Err(Error::StaleClaim) => continue,
                    Err(e) => return Err(fail(&e)),
                }
            }
            Step::Release { stale, .. } => {
                let Some(c) = (if stale { held.first() } else { held.last() }).cloned() else {
                    continue;
                };
                match store.release(&kl.key, &c) {
                    // Recorded steps outlive a release: the record stays,
                    // its lease over (the epoch marks a release).
                    // Its `written_at` stays the claim's time, before the
                    // expiry (a release does not check it).
                    Ok(()) => match before {
                        Slot::Live { steps, .. } if steps.is_empty() => Slot::Absent,
                        Slot::Live { .. } => {
                            let mut kept = before;
                            if let Slot::Live { lease_until, .. } = &mut kept {
                                *lease_until = Some(Timestamp::EPOCH);
                            }
                            kept
                        }
                        Slot::Absent => return Err(fail(&"released a claim of nothing")),
                    },
                    Err(Error::StaleClaim) => continue,
                    Err(e) => return Err(fail(&e)),
                }
            }
            Step::Record {
                stale, name, byte, ..
            } => {
                let Some(c) = (if stale { held.first() } else { held.last() }).cloned() else {
                    continue;
                };
                let step = idemstore::Step::new(format!("s{}", name % 4), vec![byte])
                    .map_err(|e| fail(&e))?;
                match store.record_step(&kl.key, &c, &step, now) {
                    // Its `written_at` stays the claim's time: inside its
                    // lease (a step may be recorded after the lease ran out,
                    // while nobody took the key over).
                    Ok(()) => match before {
                        Slot::Live { token, .. } if token == c.token() => {
                            let mut after = before;
                            if let Slot::Live { steps, .. } = &mut after
                                && !steps.contains(&step)
                            {
                                steps.push(step);
                            }
                            after
                        }
                        _ => {
                            return Err(fail(
                                &"recorded a step with a claim the log says is stale",
                            ));
                        }
                    },
                    // A stale claim, or a step of that name recorded with
                    // another output: nothing changed.
                    Err(Error::StaleClaim | Error::InvalidArgument { .. }) => continue,
                    Err(e) => return Err(fail(&e)),
                }
            }
            Step::Sweep { .. } | Step::Advance { .. } => continue,
        };
        kl.history.push(Entry {
            acked_at: backend.mutations(),
            after,
        });
    }
    Ok(log)
}
