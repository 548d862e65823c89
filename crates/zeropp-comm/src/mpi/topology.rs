//! The job's [`Topology`] from MPI: node size from `MPI_COMM_TYPE_SHARED` or an
//! override, checked for consistency on every rank at start-up.

use ::mpi::collective::{CommunicatorCollectives, SystemOperation};
use ::mpi::topology::{Communicator as _, SimpleCommunicator};

use crate::{CommError, Topology};

/// The environment variable that overrides the node size (ranks per node), e.g.
/// `ZEROPP_LOCAL_SIZE=2` simulates 4 nodes of 2 ranks with `mpirun -np 8` on one host.
pub const LOCAL_SIZE_ENV: &str = "ZEROPP_LOCAL_SIZE";

/// Where the node size came from (both must agree on every rank, because the
/// shared-memory split is collective over the world).
const FROM_OVERRIDE: u64 = 1;
const FROM_SHARED_MEMORY: u64 = 2;

/// The node size requested by `arg` or, without it, by [`LOCAL_SIZE_ENV`].
fn requested_local_size(arg: Option<usize>) -> Result<Option<usize>, CommError> {
    if arg.is_some() {
        return Ok(arg);
    }
    match std::env::var(LOCAL_SIZE_ENV) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            CommError::InvalidConfig(format!("{LOCAL_SIZE_ENV}={v:?} is not a number of ranks per node"))
        }),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(CommError::InvalidConfig(format!("{LOCAL_SIZE_ENV}: {e}"))),
    }
}

/// Checks the world ranks that share this rank's node: they must be the contiguous
/// block `[k·n, (k+1)·n)` for `n = members.len()`, the layout [`Topology`] assumes.
pub(crate) fn check_node_members(rank: usize, members: &[u64]) -> Result<(), String> {
    let n = members.len() as u64;
    let first = members.first().copied().unwrap_or(0);
    let contiguous = members.iter().enumerate().all(|(i, &m)| m == first + i as u64);
    if n == 0 || first % n != 0 || !contiguous {
        return Err(format!(
            "rank {rank} shares its node with world ranks {members:?}, not a contiguous block starting at a \
             multiple of {n}; launch with ranks packed per node (e.g. `mpirun --map-by slot`) or set {LOCAL_SIZE_ENV}"
        ));
    }
    Ok(())
}

/// Element-wise max over the world of `values` (a cheap `MPI_Allreduce`).
fn all_max(world: &SimpleCommunicator, values: &[u64]) -> Vec<u64> {
    let mut out = vec![0u64; values.len()];
    world.all_reduce_into(values, &mut out[..], SystemOperation::max());
    out
}

/// Collective over `world`: the job's topology, identical on every rank, or the
/// same error on every rank.
///
/// The node size is `local_size` if given, else [`LOCAL_SIZE_ENV`], else the size of
/// this rank's `MPI_COMM_TYPE_SHARED` split. Detected: ranks that disagree on the
/// source or value of the node size, a node size that does not divide the world,
/// and (shared-memory split) nodes whose ranks are not contiguous.
pub(crate) fn detect(world: &SimpleCommunicator, local_size: Option<usize>) -> Result<Topology, CommError> {
    let size = usize::try_from(world.size()).unwrap_or(0);
    let rank = usize::try_from(world.rank()).unwrap_or(0);

    // Round 1: agree on where the node size comes from.
    let requested = requested_local_size(local_size);
    let source = match &requested {
        Ok(Some(_)) => FROM_OVERRIDE,
        Ok(None) => FROM_SHARED_MEMORY,
        Err(_) => 0,
    };
    let bad = u64::from(requested.is_err());
    let r1 = all_max(world, &[bad, source, u64::MAX - source]);
    let (any_bad, max_source, min_source) = (r1[0], r1[1], u64::MAX - r1[2]);
    if let Err(e) = requested {
        return Err(e);
    }
    if any_bad != 0 {
        return Err(CommError::InvalidConfig(format!(
            "another rank has an invalid {LOCAL_SIZE_ENV}; see its error"
        )));
    }
    if min_source != max_source {
        return Err(CommError::InvalidConfig(format!(
            "some ranks set the node size ({LOCAL_SIZE_ENV} or the local_size option) and others do not; \
             set it on every rank or on none"
        )));
    }

    // Round 2: the node size and its layout.
    let (local, problem) = match requested {
        Ok(Some(n)) => {
            let problem = if n == 0 || size % n != 0 {
                Some(format!("a node size of {n} ranks does not divide the world of {size} ranks"))
            } else {
                None
            };
            (n, problem)
        }
        _ => {
            let node = world.split_shared(world.rank());
            let n = usize::try_from(node.size()).unwrap_or(0);
            let mut members = vec![0u64; n];
            node.all_gather_into(&(rank as u64), &mut members[..]);
            (n, check_node_members(rank, &members).err())
        }
    };
    let local64 = local as u64;
    let r2 = all_max(world, &[u64::from(problem.is_some()), local64, u64::MAX - local64]);
    let (any_problem, max_local, min_local) = (r2[0], r2[1], u64::MAX - r2[2]);
    if let Some(p) = problem {
        return Err(CommError::InvalidConfig(format!("inconsistent MPI topology: {p}")));
    }
    if any_problem != 0 {
        return Err(CommError::InvalidConfig(
            "inconsistent MPI topology detected by another rank; see its error".to_string(),
        ));
    }
    if min_local != max_local {
        return Err(CommError::InvalidConfig(format!(
            "inconsistent MPI topology: nodes have between {min_local} and {max_local} ranks (this rank: {local}); \
             every node must run the same number of ranks"
        )));
    }
    Topology::ranks(size).per_node(local)
}

#[cfg(test)]
mod tests {
    use super::check_node_members;

    #[test]
    fn contiguous_blocks_pass() {
        assert!(check_node_members(5, &[4, 5, 6, 7]).is_ok());
        assert!(check_node_members(0, &[0]).is_ok());
    }

    #[test]
    fn scattered_or_misaligned_blocks_fail() {
        assert!(check_node_members(1, &[1, 3]).is_err());
        assert!(check_node_members(2, &[1, 2]).is_err());
        assert!(check_node_members(0, &[]).is_err());
    }
}
