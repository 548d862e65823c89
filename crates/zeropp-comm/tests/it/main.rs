//! The integration tests of zeropp-comm, in one binary: one module per area.
//!
//! One binary links the crate and its dependencies once instead of once per file.
//! No test needs a process of its own: the thread backend's clusters are
//! independent values, and the link-model timing bounds (`link_model`) hold with
//! the other tests running beside them (they sleep on modelled delivery times).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

mod accuracy;
mod arguments;
mod conformance;
mod device;
#[cfg(feature = "cuda")]
mod device_gpu;
#[cfg(feature = "nccl")]
mod device_nccl;
mod device_parity;
mod faults;
mod hierarchical;
mod link_model;
mod qgz_stages;
mod qgz_streams;
mod reduce_mean;
mod traffic;
