//! # zeropp-comm
//!
//! Topology, groups, the [`Communicator`] trait with its backends, traffic
//! accounting and the ZeRO++ collectives.
//!
//! - [`Communicator`]: the group primitives a backend provides; [`CommExt`]: typed
//!   (`bytemuck::Pod`) helpers on every communicator.
//! - [`threads`]: the embedded backend ([`ThreadCluster`], [`ThreadComm`]) with an
//!   optional [`LinkModel`] enforced in wall-clock time.
//! - [`AsyncComm`] / [`Pending`]: non-blocking collectives on a worker thread.
//! - [`collectives`]: ZeRO-3 baselines and the ZeRO++ collectives (qwZ, hpZ, qgZ),
//!   written once on the primitives; their exact traffic formulas are documented there.
//! - [`quant`]: the zeropp-quant types comm's options and signatures use
//!   ([`quant::QuantSpec`], [`quant::Options`], …), so users need no direct
//!   zeropp-quant dependency.
//! - `conformance` (feature `conformance`): the backend-independent test suite.
//! - [`device`]: the primitives and the ZeRO++ collectives on device buffers
//!   ([`device::DeviceCommunicator`]), the one-device simulated cluster
//!   ([`device::DeviceCluster`]) on host memory or (feature `cuda`) a GPU, and
//!   (feature `nccl`) NCCL.
//! - `mpi` (feature `mpi`): the MPI backend (`MpiComm`), launched by `mpirun`.

mod async_comm;
mod check;
pub mod collectives;
mod communicator;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod device;
mod error;
mod ext;
pub mod group;
pub mod link;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod quant;
mod slices;
pub mod threads;
pub mod topology;
pub mod traffic;

#[cfg(feature = "mpi")]
pub use crate::mpi::{Mpi, MpiComm, MpiOptions};
pub use async_comm::{AsyncComm, Pending};
pub use check::Primitive;
pub use communicator::{Communicator, RawCall};
pub use error::CommError;
pub use ext::CommExt;
pub use group::Group;
pub use link::{Link, LinkModel};
pub use threads::{RunError, ThreadCluster, ThreadComm, ThreadOptions};
pub use topology::{Ranks, Topology};
pub use traffic::{LinkBytes, LinkClass, LinkCounters, OpTraffic, TrafficCounter, TrafficSnapshot};

/// The README's examples, run as doc tests, so the page a registry shows stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
