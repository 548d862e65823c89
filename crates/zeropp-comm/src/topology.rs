//! Cluster shape: how many ranks, how many per node, and which groups they form.

use crate::CommError;

/// The shape of a data-parallel job: `world` ranks laid out as `nodes × local_size`.
///
/// Ranks are contiguous per node, as DeepSpeed and torchrun lay them out: rank `r`
/// lives on node `r / local_size` with local rank `r % local_size`.
///
/// ```
/// use zeropp_comm::Topology;
/// let t = Topology::ranks(8).per_node(4)?;
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

/// A world size waiting for its node size: the first half of
/// `Topology::ranks(world).per_node(local_size)` ([`Topology::ranks`],
/// [`Ranks::per_node`]), so that the two numbers are never passed positionally
/// next to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a world size needs `.per_node(local_size)` to become a Topology"]
pub struct Ranks {
    world: usize,
}

impl Ranks {
    /// The topology of these ranks in nodes of `local_size`; both must be
    /// non-zero and `local_size` must divide the world size.
    pub fn per_node(self, local_size: usize) -> Result<Topology, CommError> {
        let world = self.world;
        if world == 0 || local_size == 0 || !world.is_multiple_of(local_size) {
            return Err(CommError::InvalidTopology { world, local_size });
        }
        Ok(Topology { world, local_size })
    }
}

impl Topology {
    /// Starts a topology of `world` ranks; finish it with
    /// [`Ranks::per_node`]: `Topology::ranks(8).per_node(4)` is 2 nodes of 4.
    pub fn ranks(world: usize) -> Ranks {
        Ranks { world }
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
