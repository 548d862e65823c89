//! Workspace-level integration tests live in `tests/tests/*.rs`; this library only
//! holds helpers they share.
