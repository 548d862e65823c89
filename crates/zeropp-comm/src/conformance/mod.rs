//! A backend-independent conformance suite for the primitives and collectives.
//!
//! Every rank derives its inputs from `(case.seed, rank)` with [`rank_data`], so it
//! can compute every other rank's inputs too and check its own result against a
//! sequential reference without extra communication. Every `check_*` function is
//! collective: all ranks of the world must call it with the same [`Case`]. It
//! returns `Err(description)` on a wrong result or a communication error.
//!
//! The ZeRO++ collectives' checks take a [`Collectives`]: the host
//! implementation on a communicator ([`HostPath`]) or the device one on a
//! device communicator ([`DevicePath`]), so one suite checks both.
//!
//! ```
//! use zeropp_comm::conformance::{Case, run_all};
//! use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
//! let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
//! cluster.run(|comm| run_all(comm, &Case { seed: 7, len: 13 }))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::Communicator;

mod collectives;
mod common;
mod delta;
mod errors;
mod paths;
mod primitives;
mod qgz;

pub use collectives::*;
pub use common::{Case, groups, rank_bytes, rank_data};
pub use delta::check_qwz_delta;
pub use errors::*;
pub use paths::{Collectives, CopyElem, DevicePath, HostPath};
pub use primitives::*;
pub use qgz::{check_qgz, check_ring, qgz_error_bound};

/// Runs every check of the suite on a communicator, in a fixed order: the
/// primitives, [`run_collectives`] on the host collectives ([`HostPath`]), and
/// the host functions that have no device twin.
pub fn run_all<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    check_all_gather(comm, case)?;
    check_all_to_all(comm, case)?;
    check_all_to_all_v(comm, case)?;
    check_reductions(comm, case)?;
    check_broadcast_barrier(comm, case)?;
    check_baselines(comm, case)?;
    run_collectives(&mut HostPath(&mut *comm), case)?;
    check_ring(comm, case)?;
    check_world_qwz_encodings(comm, case)?;
    check_duplicate_async(comm, case)
}

/// Runs the checks of the ZeRO++ collectives that both implementations have,
/// in a fixed order, on either ([`HostPath`] or [`DevicePath`]): the same
/// checks against the same references, so a device path passes exactly what
/// the host path passes.
pub fn run_collectives<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    check_bf16_baselines(x, case)?;
    check_qwz(x, case)?;
    check_qwz_bf16(x, case)?;
    check_qgz(x, case)?;
    check_qwz_delta(x, case)?;
    check_world_collectives(x, case)
}
