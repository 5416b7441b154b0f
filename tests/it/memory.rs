//! The conformance suite on the reference `MemoryStore`.

use crate::conformance::Subject;
use idemstore::MemoryStore;

fn subject() -> Subject {
    Subject::new(MemoryStore::new(), ())
}

conformance_suite!(subject);
