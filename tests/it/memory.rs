//! The conformance suite on the reference `MemoryStore`.

use idemstore::MemoryStore;
use idemstore_testkit::conformance::Subject;

fn subject() -> Subject {
    Subject::new(MemoryStore::new(), ())
}

idemstore_testkit::conformance!(subject);
