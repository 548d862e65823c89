//! Cluster shape: how many ranks, how many per node, and which groups they form.

use crate::CommError;

/// The shape of a data-parallel job: `world` ranks laid out as `nodes × local_size`.
///
/// Ranks are contiguous per node, as DeepSpeed and torchrun lay them out: rank `r`
/// lives on node `r / local_size` with local rank `r % local_size`.
///
/// ```
/// use zeropp_comm::Topology;
/// let t = Topology::new(8, 4)?;
/// assert_eq!(t.nodes(), 2);
/// assert_eq!(t.node_of(5), 1);
/// assert_eq!(t.local_rank(5), 1);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    world: usize,
    local_size: usize,
}

impl Topology {
    /// Builds a topology; `world` and `local_size` must be non-zero and
    /// `local_size` must divide `world`.
    pub fn new(world: usize, local_size: usize) -> Result<Self, CommError> {
        if world == 0 || local_size == 0 || !world.is_multiple_of(local_size) {
            return Err(CommError::InvalidTopology { world, local_size });
        }
        Ok(Self { world, local_size })
    }

    /// Total number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Ranks per node.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// Number of nodes (`world / local_size`).
    pub fn nodes(&self) -> usize {
        self.world / self.local_size
    }

    /// The node that hosts `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.local_size
    }

    /// The rank's index inside its node.
    pub fn local_rank(&self, rank: usize) -> usize {
        rank % self.local_size
    }

    /// The global rank of local rank `local` on node `node`.
    pub fn rank_of(&self, node: usize, local: usize) -> usize {
        node * self.local_size + local
    }

    /// True when `a` and `b` live on the same node.
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        self.node_of(a) == self.node_of(b)
    }
}
