//! Groups: the ordered sets of ranks a collective runs on.

use std::sync::Arc;

use crate::{CommError, Topology};

/// An ordered set of distinct global ranks that take part in one collective.
///
/// The position of a rank in the group (its *group index*) decides where its chunk
/// lands in gathered buffers and which chunk of a scattered buffer it receives.
///
/// ```
/// use zeropp_comm::{Group, Topology};
/// let t = Topology::ranks(8).per_node(4)?;
/// assert_eq!(Group::intra_node(&t, 5).ranks(), &[4, 5, 6, 7]);
/// assert_eq!(Group::rail(&t, 5).ranks(), &[1, 5]);
/// assert_eq!(Group::world(&t).size(), 8);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Arc<[usize]>,
}

impl Group {
    /// A group of explicit ranks, in the given order. Ranks must be distinct and
    /// below `topology.world()`; the list must not be empty.
    pub fn new(topology: &Topology, ranks: Vec<usize>) -> Result<Self, CommError> {
        if ranks.is_empty() {
            return Err(CommError::InvalidGroup("a group needs at least one rank".into()));
        }
        let mut seen = vec![false; topology.world()];
        for &r in &ranks {
            match seen.get_mut(r) {
                None => {
                    return Err(CommError::InvalidGroup(format!(
                        "rank {r} is outside a world of {}",
                        topology.world()
                    )));
                }
                Some(true) => {
                    return Err(CommError::InvalidGroup(format!("rank {r} appears twice")));
                }
                Some(s) => *s = true,
            }
        }
        Ok(Self { ranks: ranks.into() })
    }

    /// All ranks, in rank order.
    pub fn world(topology: &Topology) -> Self {
        Self { ranks: (0..topology.world()).collect() }
    }

    /// The ranks on the same node as `rank`, in local-rank order.
    pub fn intra_node(topology: &Topology, rank: usize) -> Self {
        let node = topology.node_of(rank);
        Self { ranks: (0..topology.local_size()).map(|l| topology.rank_of(node, l)).collect() }
    }

    /// The "rail": the ranks with the same local rank as `rank` on every node, in node order.
    pub fn rail(topology: &Topology, rank: usize) -> Self {
        let local = topology.local_rank(rank);
        Self { ranks: (0..topology.nodes()).map(|n| topology.rank_of(n, local)).collect() }
    }

    /// The hpZ secondary-shard group of `rank`: the `size` consecutive local ranks of
    /// its node that contain it (`size` must divide `local_size`; `size ==
    /// local_size` is [`Group::intra_node`]). hpZ gathers on this group stay on one node.
    ///
    /// ```
    /// use zeropp_comm::{Group, Topology};
    /// let t = Topology::ranks(8).per_node(4)?;
    /// assert_eq!(Group::hpz(&t, 6, 2)?.ranks(), &[6, 7]);
    /// assert_eq!(Group::hpz(&t, 6, 4)?, Group::intra_node(&t, 6));
    /// assert!(Group::hpz(&t, 6, 3).is_err());
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn hpz(topology: &Topology, rank: usize, size: usize) -> Result<Self, CommError> {
        if size == 0 || !topology.local_size().is_multiple_of(size) || rank >= topology.world() {
            return Err(CommError::InvalidGroup(format!(
                "hpZ group of {size} ranks for rank {rank}: size must divide local_size {}",
                topology.local_size()
            )));
        }
        let first = rank - topology.local_rank(rank) % size;
        Ok(Self { ranks: (first..first + size).collect() })
    }

    /// The same ranks in reverse order (a group whose order differs from rank order).
    pub fn reversed(&self) -> Self {
        Self { ranks: self.ranks.iter().rev().copied().collect() }
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The member ranks, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The group index of global rank `rank`, if it is a member.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }

    /// The global rank at group index `index`.
    pub fn rank_at(&self, index: usize) -> Option<usize> {
        self.ranks.get(index).copied()
    }
}
