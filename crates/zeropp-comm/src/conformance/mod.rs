//! A backend-independent conformance suite for the primitives and collectives.
//!
//! Every rank derives its inputs from `(case.seed, rank)` with [`rank_data`], so it
//! can compute every other rank's inputs too and check its own result against a
//! sequential reference without extra communication. Every `check_*` function is
//! collective: all ranks of the world must call it with the same [`Case`]. It
//! returns `Err(description)` on a wrong result or a communication error.
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
mod primitives;

pub use collectives::*;
pub use common::{Case, groups, rank_bytes, rank_data};
pub use delta::check_qwz_delta;
pub use errors::*;
pub use primitives::*;

/// Runs every check of the suite, in a fixed order.
pub fn run_all<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    check_all_gather(comm, case)?;
    check_all_to_all(comm, case)?;
    check_all_to_all_v(comm, case)?;
    check_reductions(comm, case)?;
    check_broadcast_barrier(comm, case)?;
    check_baselines(comm, case)?;
    check_qwz(comm, case)?;
    check_qgz(comm, case)?;
    check_qwz_delta(comm, case)?;
    check_world_collectives(comm, case)?;
    check_duplicate_async(comm, case)
}
