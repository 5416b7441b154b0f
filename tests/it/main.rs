//! The one integration-test binary. Each backend module runs the shared

#![allow(unreachable_pub, reason = "test modules share helpers with `pub`")]
//! conformance suite through `conformance_suite!`, plus its own tests.

#[macro_use]
mod conformance;
mod guard;
mod memory;
mod model;
