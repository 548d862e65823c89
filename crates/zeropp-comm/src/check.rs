//! The argument checks of the [`Communicator`](crate::Communicator) primitives,
//! written once: every backend reports the same error variant with the same words.
//!
//! [`Primitive`] names the primitives here, below the trait that declares them.
//!
//! Order: the group (every member inside the world), then membership of the
//! caller, then the primitive's own arguments (buffer lengths, counts, root).

use std::fmt;

use crate::{CommError, Group, Topology};

/// A primitive of [`Communicator`](crate::Communicator), by the name error messages use.
///
/// ```
/// use zeropp_comm::Primitive;
/// assert_eq!(Primitive::AllToAllV.name(), "all_to_all_v");
/// assert_eq!(Primitive::ALL.len(), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Primitive {
    /// [`Communicator::all_gather_bytes`](crate::Communicator::all_gather_bytes).
    AllGather,
    /// [`Communicator::all_to_all_bytes`](crate::Communicator::all_to_all_bytes).
    AllToAll,
    /// [`Communicator::all_to_all_v_bytes`](crate::Communicator::all_to_all_v_bytes).
    AllToAllV,
    /// [`Communicator::reduce_scatter_f32`](crate::Communicator::reduce_scatter_f32).
    ReduceScatter,
    /// [`Communicator::all_reduce_f32`](crate::Communicator::all_reduce_f32).
    AllReduce,
    /// [`Communicator::broadcast_bytes`](crate::Communicator::broadcast_bytes).
    Broadcast,
    /// [`Communicator::barrier`](crate::Communicator::barrier).
    Barrier,
}

impl Primitive {
    /// Every primitive, in declaration order.
    pub const ALL: [Primitive; 7] = [
        Primitive::AllGather,
        Primitive::AllToAll,
        Primitive::AllToAllV,
        Primitive::ReduceScatter,
        Primitive::AllReduce,
        Primitive::Broadcast,
        Primitive::Barrier,
    ];

    /// The name in error messages: `all_gather`, `all_to_all`, `all_to_all_v`,
    /// `reduce_scatter`, `all_reduce`, `broadcast` or `barrier`.
    pub fn name(self) -> &'static str {
        match self {
            Primitive::AllGather => "all_gather",
            Primitive::AllToAll => "all_to_all",
            Primitive::AllToAllV => "all_to_all_v",
            Primitive::ReduceScatter => "reduce_scatter",
            Primitive::AllReduce => "all_reduce",
            Primitive::Broadcast => "broadcast",
            Primitive::Barrier => "barrier",
        }
    }
}

impl fmt::Display for Primitive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Checks that `group` fits the world and contains `rank`; returns the caller's
/// group index. Both failures are [`CommError::InvalidGroup`].
pub(crate) fn member(
    topology: &Topology,
    rank: usize,
    group: &Group,
    p: Primitive,
) -> Result<usize, CommError> {
    let world = topology.world();
    if let Some(&r) = group.ranks().iter().find(|&&r| r >= world) {
        return Err(CommError::InvalidGroup(format!("rank {r} is outside a world of {world}")));
    }
    group.index_of(rank).ok_or_else(|| {
        CommError::InvalidGroup(format!(
            "rank {rank} called {p} on group {:?} without being a member",
            group.ranks()
        ))
    })
}

/// The lengths [`arguments_of`] checks: bytes (elements for the f32 primitives),
/// counts, root. Host calls (`RawCall`) and device calls
/// (`device::DeviceCommunicator`) both reduce to it, so they fail alike.
pub(crate) struct Shape<'a> {
    pub(crate) send: usize,
    pub(crate) send_counts: &'a [usize],
    pub(crate) recv: usize,
    pub(crate) recv_counts: &'a [usize],
    pub(crate) root: usize,
}

impl Shape<'_> {
    /// Two buffer lengths, no counts, root 0.
    pub(crate) fn buffers(send: usize, recv: usize) -> Self {
        Shape { send, send_counts: &[], recv, recv_counts: &[], root: 0 }
    }
}

/// The arguments of primitive `p` with lengths `shape`, by member `index` of `group`.
pub(crate) fn arguments_of(
    group: &Group,
    index: usize,
    p: Primitive,
    shape: &Shape<'_>,
) -> Result<(), CommError> {
    let g = group.size();
    let (send, recv) = (shape.send, shape.recv);
    match p {
        Primitive::AllGather => whole_of_chunks(g, send, recv, || {
            format!("{p}: receive buffer of {recv} bytes for {g} chunks of {send} bytes")
        }),
        Primitive::AllToAll => all_to_all(group, send, recv).map(drop),
        Primitive::AllToAllV => all_to_all_v(group, index, send, shape.send_counts, recv, shape.recv_counts),
        Primitive::ReduceScatter => whole_of_chunks(g, recv, send, || {
            format!("{p}: send of {send} elements for {g} chunks of {recv}")
        }),
        Primitive::Broadcast => broadcast(group, shape.root).map(drop),
        Primitive::AllReduce | Primitive::Barrier => Ok(()),
    }
}

/// `whole == chunk · g`, else a [`CommError::Mismatch`] saying `why()`.
fn whole_of_chunks(
    g: usize,
    chunk: usize,
    whole: usize,
    why: impl FnOnce() -> String,
) -> Result<(), CommError> {
    if chunk.checked_mul(g) == Some(whole) { Ok(()) } else { Err(CommError::Mismatch(why())) }
}

/// `send == recv`, a multiple of `g`; returns the chunk length.
fn all_to_all(group: &Group, send: usize, recv: usize) -> Result<usize, CommError> {
    let g = group.size();
    if send != recv || !send.is_multiple_of(g) {
        return Err(CommError::Mismatch(format!(
            "{}: send {send} and receive {recv} bytes must be equal multiples of the group size {g}",
            Primitive::AllToAll
        )));
    }
    Ok(send / g)
}

/// `g` counts each, adding up to the buffer lengths, the caller's own chunk the
/// same both ways.
fn all_to_all_v(
    group: &Group,
    index: usize,
    send: usize,
    send_counts: &[usize],
    recv: usize,
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let p = Primitive::AllToAllV;
    let g = group.size();
    if send_counts.len() != g || recv_counts.len() != g {
        return Err(CommError::Mismatch(format!(
            "{p}: {} send and {} receive counts for a group of {g}",
            send_counts.len(),
            recv_counts.len()
        )));
    }
    // Saturating: a sum that overflows cannot equal a buffer length.
    let total = |counts: &[usize]| counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
    let (ts, tr) = (total(send_counts), total(recv_counts));
    if ts != send || tr != recv {
        return Err(CommError::Mismatch(format!(
            "{p}: counts do not add up to the buffer lengths (send counts {ts} for {send} bytes, receive counts {tr} for {recv} bytes)"
        )));
    }
    match (send_counts.get(index), recv_counts.get(index)) {
        (Some(s), Some(r)) if s == r => Ok(()),
        (Some(s), Some(r)) => {
            Err(CommError::Mismatch(format!("{p}: this rank sends itself {s} bytes but expects {r}")))
        }
        _ => Err(CommError::InvalidGroup(format!("{p}: group index {index} in a group of {g}"))),
    }
}

/// `root` is a group index; returns the root's global rank.
pub(crate) fn broadcast(group: &Group, root: usize) -> Result<usize, CommError> {
    group.rank_at(root).ok_or_else(|| {
        CommError::InvalidGroup(format!(
            "{} root index {root} in a group of {}",
            Primitive::Broadcast,
            group.size()
        ))
    })
}
