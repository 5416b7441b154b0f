//! [`Step`]: one recorded step of a run, its limits, and the stable key a
//! step passes downstream ([`Key::step_key`]).
//!
//! A handler with several side effects (charge, reserve, send) records each
//! one's output on the key's PROCESSING record as it finishes. A retry that
//! takes the key over after a crash starts with those outputs
//! ([`Claim::steps`](crate::Claim::steps)) and skips the steps that made
//! them. Steps live as long as the claim's record is PROCESSING (across
//! takeovers and a [`release`](crate::Store::release)) and are dropped when
//! it completes or expires.

use crate::error::{Error, Result};
use crate::key::Key;
use sha2::{Digest, Sha256};

/// Most steps one record may hold.
pub const MAX_STEPS: usize = 32;
/// Longest step name, in bytes (at least 1).
pub const MAX_STEP_NAME_BYTES: usize = 64;
/// Largest output of one step, in bytes.
pub const MAX_STEP_OUTPUT_BYTES: usize = 64 * 1024;
/// Most bytes of step names and outputs one record may hold in all.
pub const MAX_STEPS_BYTES: usize = 256 * 1024;

/// A step's recorded output, under the step's name.
///
/// ```
/// use idemstore::Step;
///
/// let step = Step::new("charge", b"ch_123".to_vec())?;
/// assert_eq!((step.name(), step.output()), ("charge", &b"ch_123"[..]));
/// assert!(Step::new("", vec![]).is_err());
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    pub(crate) name: String,
    pub(crate) output: Vec<u8>,
}

impl Step {
    /// A step named `name` (1..=[`MAX_STEP_NAME_BYTES`] bytes) with its
    /// output (at most [`MAX_STEP_OUTPUT_BYTES`]); else
    /// [`Error::StepLimit`] ([`Error::InvalidArgument`] for an empty name),
    /// before any I/O.
    pub fn new(name: impl Into<String>, output: Vec<u8>) -> Result<Step> {
        let name = name.into();
        check_name(&name)?;
        over("output bytes", output.len(), MAX_STEP_OUTPUT_BYTES)?;
        Ok(Step { name, output })
    }
    /// The step's name, unique within its record.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// What the step returned when it ran.
    pub fn output(&self) -> &[u8] {
        &self.output
    }
    /// Bytes this step counts against [`MAX_STEPS_BYTES`].
    pub(crate) fn bytes(&self) -> usize {
        self.name.len() + self.output.len()
    }
}

/// A name of 1..=[`MAX_STEP_NAME_BYTES`] bytes.
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_argument("a step name is empty"));
    }
    over("name bytes", name.len(), MAX_STEP_NAME_BYTES)
}

fn over(what: &'static str, size: usize, limit: usize) -> Result<()> {
    if size > limit {
        return Err(Error::StepLimit { what, size, limit });
    }
    Ok(())
}

/// Checks a record's steps against the per-record limits: at most
/// [`MAX_STEPS`], [`MAX_STEPS_BYTES`] in all, names unique.
pub(crate) fn check_all(steps: &[Step]) -> Result<()> {
    over("steps", steps.len(), MAX_STEPS)?;
    over(
        "step bytes in the record",
        steps.iter().map(Step::bytes).sum(),
        MAX_STEPS_BYTES,
    )?;
    for (i, step) in steps.iter().enumerate() {
        check_name(&step.name)?;
        if steps
            .get(..i)
            .is_some_and(|s| s.iter().any(|o| o.name == step.name))
        {
            return Err(Error::invalid_argument(format!(
                "step `{}` is recorded twice",
                step.name
            )));
        }
    }
    Ok(())
}

impl Key {
    /// The key a step passes to the system it calls (a payment provider's
    /// `Idempotency-Key`, a message id): 32 hex digits derived from this
    /// key's scope and id and the step's name alone, so every attempt and
    /// every owner of this key sends the same one, and two steps or two
    /// keys never share one.
    ///
    /// Use it where the downstream system deduplicates by key: a retry that
    /// re-runs a step whose output was not recorded (the process died after
    /// the call, before the record) is then deduplicated downstream. Use the
    /// claim's [fencing token](crate::Claim::token) instead where the
    /// downstream system must refuse a stale owner: it changes at every
    /// takeover and only grows.
    ///
    /// ```
    /// use idemstore::Key;
    ///
    /// let key = Key::new("tenant-42", "order-1")?;
    /// let charge = key.step_key("charge");
    /// assert_eq!(charge.len(), 32);
    /// assert_eq!(charge, Key::new("tenant-42", "order-1")?.step_key("charge"));
    /// assert_ne!(charge, key.step_key("email"));
    /// assert_ne!(charge, Key::new("tenant-43", "order-1")?.step_key("charge"));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn step_key(&self, name: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"idemstore step key\0");
        // Length-prefixed parts: no two (scope, id, name) hash the same input.
        for part in [self.scope(), self.id(), name.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        h.finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, bytes: usize) -> Step {
        Step {
            name: name.to_owned(),
            output: vec![7; bytes],
        }
    }

    #[test]
    fn a_step_is_refused_over_each_limit_and_accepted_at_it() {
        let small = Step::new("n", vec![1, 2]).expect("valid");
        assert_eq!((small.name(), small.output()), ("n", &[1u8, 2][..]));
        let name = "n".repeat(MAX_STEP_NAME_BYTES);
        assert!(Step::new(name.clone(), vec![0; MAX_STEP_OUTPUT_BYTES]).is_ok());
        let long = Step::new(format!("{name}n"), vec![]);
        assert!(matches!(
            long,
            Err(Error::StepLimit { what: "name bytes", size, limit: MAX_STEP_NAME_BYTES })
                if size == MAX_STEP_NAME_BYTES + 1
        ));
        let big = Step::new("a", vec![0; MAX_STEP_OUTPUT_BYTES + 1]);
        assert!(matches!(
            big,
            Err(Error::StepLimit {
                what: "output bytes",
                ..
            })
        ));
        assert!(matches!(
            Step::new("", vec![]),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn a_record_is_refused_over_its_step_limits() {
        let full: Vec<Step> = (0..MAX_STEPS).map(|i| step(&i.to_string(), 0)).collect();
        assert!(check_all(&full).is_ok());
        let mut more = full.clone();
        more.push(step("x", 0));
        assert!(matches!(
            check_all(&more),
            Err(Error::StepLimit { what: "steps", size, .. }) if size == MAX_STEPS + 1
        ));
        // Four outputs of 64 KiB with their names pass 256 KiB.
        let heavy: Vec<Step> = (0..4)
            .map(|i| step(&i.to_string(), MAX_STEP_OUTPUT_BYTES))
            .collect();
        assert!(matches!(
            check_all(&heavy),
            Err(Error::StepLimit {
                what: "step bytes in the record",
                ..
            })
        ));
        assert!(check_all(heavy.get(..3).unwrap_or_default()).is_ok());
        let twice = [step("a", 1), step("b", 1), step("a", 2)];
        assert!(matches!(
            check_all(&twice),
            Err(Error::InvalidArgument { reason }) if reason.contains("`a`")
        ));
    }

    #[test]
    fn step_keys_are_fixed_and_unambiguous() {
        let key = |s: &str, i: &str| Key::new(s, i).expect("valid");
        // Pinned: a step key must never change between releases, or a
        // retry after an upgrade would send the downstream system a new key.
        assert_eq!(
            key("tenant-42", "order-1").step_key("charge"),
            key("tenant-42", "order-1").step_key("charge")
        );
        assert_eq!(
            key("", "k").step_key("s"),
            "f2dc0879826b3e37c02ba4f550f0b32f"
        );
        // Moving bytes between the parts changes the key.
        assert_ne!(key("ab", "c").step_key("d"), key("a", "bc").step_key("d"));
        assert_ne!(key("a", "bc").step_key("d"), key("a", "b").step_key("cd"));
    }
}
