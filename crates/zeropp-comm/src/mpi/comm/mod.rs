//! [`MpiComm`]: the [`Communicator`] of the MPI backend.

use std::collections::HashMap;
use std::sync::Arc;

use ::mpi::collective::{CommunicatorCollectives, SystemOperation};
use ::mpi::topology::{Communicator as _, Group as _};

use super::ffi::SendComm;
use super::{Env, MpiOptions};
use crate::slices::copy_to;
use crate::{CommError, Communicator, Group, Primitive, RawCall, Topology, TrafficCounter};

mod primitives;

/// One rank's communicator of the MPI backend.
///
/// Built by [`super::Mpi::communicator`] (or [`MpiComm::init`]) on a private
/// duplicate of `MPI_COMM_WORLD`. Each distinct [`Group`] gets its own MPI
/// sub-communicator, created with `MPI_Comm_create_group` (collective over the
/// group's members only) the first time the group is used, and cached by its rank
/// list; the world group in rank order uses the base communicator itself. Every
/// primitive is one MPI collective on that communicator (see the module docs for
/// the mapping and for what is validated).
pub struct MpiComm {
    /// A duplicate of `MPI_COMM_WORLD` (None only while dropping).
    base: Option<SendComm>,
    /// Sub-communicators by member list (group order).
    subs: HashMap<Vec<usize>, SendComm>,
    rank: usize,
    topology: Topology,
    traffic: TrafficCounter,
    options: MpiOptions,
    /// Keeps MPI initialized; dropped after the communicators above.
    env: Arc<Env>,
}

/// Largest element count MPI's `int` counts can express.
const MAX_COUNT: usize = i32::MAX as usize;

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// A stable tag for `MPI_Comm_create_group` (FNV-1a of the member list, in
/// `1..=32767`, the smallest `MPI_TAG_UB` the standard allows).
fn group_tag(ranks: &[usize]) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in ranks {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    1 + (h % 32767) as i32
}

/// Sums member chunks in group order, starting from zero: `out[e] = ((0 + c_0[e]) + c_1[e]) + …`,
/// the order of the thread backend.
fn ordered_sum(out: &mut [f32], chunks: &[f32]) {
    out.fill(0.0);
    let n = out.len();
    if n == 0 {
        return;
    }
    for chunk in chunks.chunks_exact(n) {
        out.iter_mut().zip(chunk).for_each(|(a, b)| *a += b);
    }
}

impl MpiComm {
    pub(crate) fn new(env: Arc<Env>, options: MpiOptions) -> Result<Self, CommError> {
        env.check_thread()?;
        let base = SendComm::new(::mpi::topology::SimpleCommunicator::world().duplicate());
        let topology = super::topology::detect(base.get(), options.local_size)?;
        let rank = usize::try_from(base.get().rank()).unwrap_or(0);
        Ok(Self {
            base: Some(base),
            subs: HashMap::new(),
            rank,
            topology,
            traffic: TrafficCounter::new(topology, rank),
            options,
            env,
        })
    }

    /// Initializes MPI (see [`super::Mpi::init`]) and builds the world communicator
    /// in one call; MPI stays initialized while this communicator (or a duplicate)
    /// lives and is finalized when the last one is dropped. Collective over the world.
    pub fn init(options: MpiOptions) -> Result<Self, CommError> {
        super::Mpi::init()?.communicator(options)
    }

    /// The options this communicator was built with.
    pub fn options(&self) -> &MpiOptions {
        &self.options
    }

    /// The threading level MPI provides to this process.
    pub fn thread_level(&self) -> super::ThreadLevel {
        self.env.level
    }

    /// Ends the whole job: prints `message` with this rank's id to stderr and calls
    /// `MPI_Abort(MPI_COMM_WORLD, code)`, so mpirun stops every rank and exits non-zero.
    pub fn abort(&self, code: i32, message: &str) -> ! {
        super::abort(code, message)
    }

    /// True when `group` is the world in rank order (served by the base communicator).
    fn is_world(&self, group: &Group) -> bool {
        group.size() == self.topology.world() && group.ranks().iter().enumerate().all(|(i, &r)| i == r)
    }

    /// Creates the sub-communicator of `group` on first use (collective over its members).
    fn ensure(&mut self, group: &Group) -> Result<(), CommError> {
        if self.is_world(group) || self.subs.contains_key(group.ranks()) {
            return Ok(());
        }
        let base = self
            .base
            .as_ref()
            .ok_or_else(|| CommError::Closed("MPI communicator already released".into()))?;
        let ranks: Vec<i32> = group.ranks().iter().map(|&r| count(r)).collect();
        let mpi_group = base.get().group().include(&ranks);
        let sub =
            base.get().split_by_subgroup_with_tag(&mpi_group, group_tag(group.ranks())).ok_or_else(|| {
                CommError::InvalidGroup(format!(
                    "MPI_Comm_create_group returned no communicator for group {:?} on rank {}",
                    group.ranks(),
                    self.rank
                ))
            })?;
        self.subs.insert(group.ranks().to_vec(), SendComm::new(sub));
        Ok(())
    }

    /// The MPI communicator of `group` (after [`Self::ensure`]).
    fn comm_of(&self, group: &Group) -> Result<&::mpi::topology::SimpleCommunicator, CommError> {
        let found = if self.is_world(group) { self.base.as_ref() } else { self.subs.get(group.ranks()) };
        found.map(SendComm::get).ok_or_else(|| {
            CommError::InvalidGroup(format!("no MPI communicator for group {:?}", group.ranks()))
        })
    }

    /// The shared body of the collectives whose members all send chunks of
    /// one size (`send` holds `parts` of them): checks the thread and the
    /// chunk size, copies for a group of one, agrees on the chunk size with
    /// the peers, then runs `exchange` on buffers MPI can point into.
    fn fixed_chunks(
        &mut self,
        group: &Group,
        op: &'static str,
        parts: usize,
        send: &[u8],
        recv: &mut [u8],
        exchange: impl FnOnce(&::mpi::topology::SimpleCommunicator, &[u8], &mut [u8]),
    ) -> Result<(), CommError> {
        let c = send.len() / parts;
        let local = too_big(op, "a chunk", c);
        if group.size() == 1 {
            return single_member(local, || copy_to(recv, 0, send, &format!("{op}: receive buffer")));
        }
        self.prepare(group, op, &[(CHUNK, c as u64)], local, false)?;
        let (s0, mut r0) = ([0u8; 1], [0u8; 1]);
        exchange(self.comm_of(group)?, real_ptr(send, &s0), real_ptr_mut(recv, &mut r0));
        Ok(())
    }

    /// Prepares a collective on `group` with `g > 1` members: creates the
    /// sub-communicator and makes every member agree on `values` and on whether
    /// some member's arguments were invalid (`local`). With `check_sizes` off only
    /// the local error is reported (locally).
    fn prepare(
        &mut self,
        group: &Group,
        op: &str,
        values: &[(&str, u64)],
        local: Option<CommError>,
        always_check: bool,
    ) -> Result<(), CommError> {
        self.ensure(group)?;
        if !(self.options.check_sizes || always_check) {
            return local.map_or(Ok(()), Err);
        }
        let comm = self.comm_of(group)?;
        agree(comm, op, values, local)
    }
}

/// One `MPI_Allreduce(MAX)` over `[error flag, v, MAX - v, …]`: every member
/// learns whether any member rejected its arguments and the min/max of each value.
fn agree(
    comm: &::mpi::topology::SimpleCommunicator,
    op: &str,
    values: &[(&str, u64)],
    local: Option<CommError>,
) -> Result<(), CommError> {
    let mut mine = Vec::with_capacity(1 + 2 * values.len());
    mine.push(u64::from(local.is_some()));
    for &(_, v) in values {
        mine.push(v);
        mine.push(u64::MAX - v);
    }
    let mut all = vec![0u64; mine.len()];
    comm.all_reduce_into(&mine[..], &mut all[..], SystemOperation::max());
    if let Some(e) = local {
        return Err(e);
    }
    if all.first().copied().unwrap_or(0) != 0 {
        return Err(CommError::Mismatch(format!(
            "{op}: another member of the group rejected its arguments (see that rank's error)"
        )));
    }
    for (k, &(name, v)) in values.iter().enumerate() {
        let max = all.get(1 + 2 * k).copied().unwrap_or(v);
        let min = u64::MAX - all.get(2 + 2 * k).copied().unwrap_or(u64::MAX - v);
        if min != max {
            return Err(CommError::Mismatch(format!(
                "{op}: group members disagree on {name}: between {min} and {max} (this rank: {v})"
            )));
        }
    }
    Ok(())
}

fn too_big(op: &str, what: &str, n: usize) -> Option<CommError> {
    (n > MAX_COUNT).then(|| {
        CommError::Mismatch(format!(
            "{op}: {what} of {n} elements exceeds MPI's int count limit ({MAX_COUNT})"
        ))
    })
}

/// OpenMPI defines `MPI_IN_PLACE` as `(void*)1`, which is exactly the dangling
/// pointer of an empty `[u8]`: MPI would take an empty buffer for "in place". Empty
/// byte buffers are therefore replaced by an empty slice of a real array (`spare`).
fn real_ptr<'a>(buf: &'a [u8], spare: &'a [u8; 1]) -> &'a [u8] {
    if buf.is_empty() { &spare[..0] } else { buf }
}

/// [`real_ptr`] for receive buffers.
fn real_ptr_mut<'a>(buf: &'a mut [u8], spare: &'a mut [u8; 1]) -> &'a mut [u8] {
    if buf.is_empty() { &mut spare[..0] } else { buf }
}

/// Byte offsets (as MPI `int`s) of consecutive chunks of `counts` bytes.
fn displacements(counts: &[usize]) -> Vec<i32> {
    let mut at = 0usize;
    counts
        .iter()
        .map(|&c| {
            let d = count(at);
            at += c;
            d
        })
        .collect()
}

/// A group of one member needs no MPI call: report the local argument error, if
/// any, else do the local part of the collective.
fn single_member(
    local: Option<CommError>,
    op: impl FnOnce() -> Result<(), CommError>,
) -> Result<(), CommError> {
    match local {
        Some(e) => Err(e),
        None => op(),
    }
}

/// The values every member of a fixed-size primitive must agree on (see
/// [`MpiComm::prepare`]); their number decides the length of the agreement round,
/// so a member that rejected its arguments ([`Communicator::raw_reject`]) sends
/// as many (their values do not matter: the error flag is checked first).
const CHUNK: &str = "the chunk length";
const LENGTH: &str = "the length";
const ROOT: &str = "the root";

impl MpiComm {
    /// The agreement round of `primitive` for a member whose arguments were
    /// rejected with `error` (the twin of the round `raw` runs), so the
    /// other members fail with [`CommError::Mismatch`] instead of waiting.
    fn reject(&mut self, group: &Group, primitive: Primitive, error: CommError) -> Result<(), CommError> {
        self.env.check_thread()?;
        let g = group.size();
        if g == 1 {
            return Err(error);
        }
        let op = primitive.name();
        match primitive {
            Primitive::AllGather | Primitive::AllToAll | Primitive::ReduceScatter => {
                self.prepare(group, op, &[(CHUNK, 0)], Some(error), false)
            }
            Primitive::AllReduce => self.prepare(group, op, &[(LENGTH, 0)], Some(error), false),
            Primitive::Broadcast => self.prepare(group, op, &[(LENGTH, 0), (ROOT, 0)], Some(error), false),
            Primitive::AllToAllV => {
                self.ensure(group)?;
                // Announce "rejected" to every peer in the counts round, then the flag round.
                let announced = vec![u64::MAX; g];
                let mut incoming = vec![0u64; g];
                self.comm_of(group)?.all_to_all_into(&announced[..], &mut incoming[..]);
                self.prepare(group, op, &[], Some(error), true)
            }
            // A barrier takes no arguments to reject; other primitives (none yet) fail locally.
            _ => Err(error),
        }
    }
}

impl Communicator for MpiComm {
    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(self.split_stream()?))
    }

    fn traffic(&self) -> &TrafficCounter {
        &self.traffic
    }

    fn traffic_mut(&mut self) -> &mut TrafficCounter {
        &mut self.traffic
    }

    fn raw_reject(
        &mut self,
        group: &Group,
        _index: usize,
        primitive: Primitive,
        error: CommError,
    ) -> CommError {
        match self.reject(group, primitive, error) {
            Err(e) => e,
            Ok(()) => CommError::Mismatch(format!("{primitive}: arguments rejected")),
        }
    }

    fn raw(&mut self, group: &Group, _index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        self.env.check_thread()?;
        match call {
            RawCall::AllGather { send, recv } => {
                self.fixed_chunks(group, "all_gather", 1, send, recv, |c, s, r| c.all_gather_into(s, r))
            }
            RawCall::AllToAll { send, recv } => {
                let parts = group.size();
                self.fixed_chunks(group, "all_to_all", parts, send, recv, |c, s, r| c.all_to_all_into(s, r))
            }
            RawCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                self.mpi_all_to_all_v(group, (send, send_counts), (recv, recv_counts))
            }
            RawCall::ReduceScatter { send, recv } => self.mpi_reduce_scatter(group, send, recv),
            RawCall::AllReduce { buf } => self.mpi_all_reduce(group, buf),
            RawCall::Broadcast { root, buf } => self.mpi_broadcast(group, root, buf),
            RawCall::Barrier if group.size() == 1 => Ok(()),
            RawCall::Barrier => {
                self.ensure(group)?;
                self.comm_of(group)?.barrier();
                Ok(())
            }
        }
    }
}

impl MpiComm {
    /// Like [`Communicator::duplicate`] but keeps the concrete type: an
    /// `MPI_Comm_dup` of this communicator's world (same topology and options,
    /// fresh traffic counters and sub-communicator cache). Collective over the world.
    /// Using the copy on another thread needs `MPI_THREAD_MULTIPLE`.
    pub fn split_stream(&mut self) -> Result<MpiComm, CommError> {
        self.env.check_thread()?;
        let base = self
            .base
            .as_ref()
            .ok_or_else(|| CommError::Closed("MPI communicator already released".into()))?;
        let dup = SendComm::new(base.get().duplicate());
        Ok(MpiComm {
            base: Some(dup),
            subs: HashMap::new(),
            rank: self.rank,
            topology: self.topology,
            traffic: TrafficCounter::new(self.topology, self.rank),
            options: self.options.clone(),
            env: Arc::clone(&self.env),
        })
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            super::abort(1, "a thread panicked while holding an MPI communicator");
        }
        let allowed = self.env.check_thread().is_ok();
        let handles = self.base.take().into_iter().chain(self.subs.drain().map(|(_, c)| c));
        for h in handles {
            if allowed {
                drop(h);
            } else {
                h.leak();
            }
        }
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .field("sub_communicators", &self.subs.len())
            .field("options", &self.options)
            .finish()
    }
}
