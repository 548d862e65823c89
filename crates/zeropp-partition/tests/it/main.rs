//! The integration tests of `zeropp-partition`, in one test binary (one link
//! instead of one per file): a module per area.
//!
//! Proptest failure seeds persist next to the module that found them
//! (`tests/it/<module>.proptest-regressions`); commit them when they appear.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

mod alloc_count;
mod checkpoint;
mod checkpoint_extras;
mod checkpoint_stream;
mod layout;
mod plan;
mod proptest_plan;
