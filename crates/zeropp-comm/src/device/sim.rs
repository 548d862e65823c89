//! The one-device simulated cluster: [`DeviceCluster`] and its [`DeviceComm`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::rendezvous::{Key, Post, Rendezvous};
use super::{Device, DeviceBuf, DeviceCall, DeviceCommunicator, Elem, Kernel, QuantTimer, View};
use crate::threads::{first_failure, run_ranks};
use crate::{CommError, Group, LinkClass, LinkModel, RunError, ThreadOptions, Topology, TrafficCounter};

/// A simulated cluster of `topology.world()` ranks on one [`Device`]: one host
/// thread per rank, each with its own stream and buffers; collectives are
/// device-to-device copies and kernels ordered by events (see [`crate::device`]).
///
/// It takes the thread backend's [`ThreadOptions`]: the timeout for a silent peer
/// and the optional [`LinkModel`], enforced in wall-clock time as there (each rank
/// has one egress port per link class; a message arrives `latency + bytes /
/// bandwidth` after its port is free).
///
/// ```
/// use zeropp_comm::device::{DeviceBuf, DeviceCluster, DeviceCommunicator, HostDevice};
/// use zeropp_comm::{Group, ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(4).per_node(2)?, HostDevice, ThreadOptions::default());
/// let sums = cluster.run(|comm| {
///     let (dev, world) = (*comm.device(), Group::world(comm.topology()));
///     let x = DeviceBuf::from_f32(&dev, comm.stream(), &[comm.rank() as f32, 1.0])?;
///     comm.all_reduce_f32(&world, x.view())?;
///     x.to_f32(&dev, comm.stream())
/// })?;
/// assert!(sums.iter().all(|s| s == &[6.0, 4.0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct DeviceCluster<D: Device> {
    topology: Topology,
    device: D,
    options: ThreadOptions,
}

impl<D: Device> DeviceCluster<D> {
    /// A cluster of `topology.world()` ranks on `device`.
    pub fn new(topology: Topology, device: D, options: ThreadOptions) -> Self {
        Self { topology, device, options }
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Runs `f` on every rank and returns the values in rank order, or the first
    /// failure (a panic first, else the lowest rank's error), as
    /// [`ThreadCluster::run`](crate::ThreadCluster::run).
    pub fn run<T, E, F>(&self, f: F) -> Result<Vec<T>, RunError<E>>
    where
        F: Fn(&mut DeviceComm<D>) -> Result<T, E> + Sync,
        T: Send,
        E: Send,
    {
        first_failure(self.run_each(f))
    }

    /// Runs `f` on every rank and returns each rank's outcome, in rank order.
    pub fn run_each<T, E, F>(&self, f: F) -> Vec<Result<T, RunError<E>>>
    where
        F: Fn(&mut DeviceComm<D>) -> Result<T, E> + Sync,
        T: Send,
        E: Send,
    {
        let world = self.topology.world();
        let rdv = Arc::new(Rendezvous::new(world, self.options.timeout));
        run_ranks(
            world,
            "zeropp-device-rank",
            |rank| {
                let device = self.device.clone();
                DeviceComm::new(rank, self.topology, device, Arc::clone(&rdv), self.options.link_model)
            },
            |rank, reason| rdv.mark_lost(rank, reason),
            &f,
        )
    }
}

/// One rank of a [`DeviceCluster`]: a [`DeviceCommunicator`] on its own stream,
/// and a host [`Communicator`](crate::Communicator) that stages host buffers
/// through device buffers (so host code and the conformance suite run on it).
#[derive(Debug)]
pub struct DeviceComm<D: Device> {
    rank: usize,
    topology: Topology,
    device: D,
    stream: D::Stream,
    rdv: Arc<Rendezvous<D>>,
    /// The communicator's identity: the root is `[]`, duplicate `k` of it `[k]`, …
    path: Vec<u32>,
    seqs: HashMap<Vec<usize>, u64>,
    dups: u32,
    traffic: TrafficCounter,
    link: Option<LinkModel>,
    /// When this rank's intra- and inter-node egress ports are free (link model).
    ports: [Instant; 2],
    timer: Option<Arc<QuantTimer>>,
}

impl<D: Device> std::fmt::Debug for Rendezvous<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rendezvous")
    }
}

impl<D: Device> DeviceComm<D> {
    fn new(
        rank: usize,
        topology: Topology,
        device: D,
        rdv: Arc<Rendezvous<D>>,
        link: Option<LinkModel>,
    ) -> Result<Self, CommError> {
        let stream = device.stream()?;
        let now = Instant::now();
        Ok(Self {
            rank,
            topology,
            device,
            stream,
            rdv,
            path: Vec::new(),
            seqs: HashMap::new(),
            dups: 0,
            traffic: TrafficCounter::new(topology, rank),
            link,
            ports: [now, now],
            timer: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// This rank's stream.
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    /// The traffic counters (shared by the device and the host primitives).
    pub fn traffic(&self) -> &TrafficCounter {
        &self.traffic
    }

    /// Mutable traffic counters.
    pub fn traffic_mut(&mut self) -> &mut TrafficCounter {
        &mut self.traffic
    }

    /// Times this rank's quantization kernels into `timer` (benches), or stops.
    pub fn set_quant_timer(&mut self, timer: Option<Arc<QuantTimer>>) {
        self.timer = timer;
    }

    pub(crate) fn dup(&mut self) -> Result<Self, CommError> {
        let mut path = self.path.clone();
        path.push(self.dups);
        self.dups += 1;
        let mut c =
            Self::new(self.rank, self.topology, self.device.clone(), Arc::clone(&self.rdv), self.link)?;
        c.path = path;
        Ok(c)
    }

    /// When each member receives this rank's message under the link model.
    fn arrivals(&mut self, group: &Group, index: usize, call: &DeviceCall<'_, D>) -> Vec<Option<Instant>> {
        let g = group.size();
        let mut out = vec![None; g];
        let Some(model) = self.link else { return out };
        let payload = |j: usize| -> Option<Vec<usize>> {
            Some(match call {
                DeviceCall::AllGather { send, .. } => vec![send.len()],
                DeviceCall::AllToAll { send, .. } => vec![send.len() / g],
                DeviceCall::AllToAllV { send_counts, .. } => vec![send_counts.get(j).copied().unwrap_or(0)],
                DeviceCall::ReduceScatterF32 { recv, .. } => vec![recv.len()],
                DeviceCall::AllReduceF32 { buf } => vec![4 * (buf.len() / 4).div_ceil(g); 2],
                DeviceCall::Broadcast { root, buf } => {
                    if *root != index {
                        return None;
                    }
                    vec![buf.len()]
                }
                DeviceCall::Barrier => vec![0],
            })
        };
        for (j, &peer) in group.ranks().iter().enumerate() {
            if j == index {
                continue;
            }
            let Some(msgs) = payload(j) else { continue };
            let class = LinkClass::between(&self.topology, self.rank, peer);
            let port = usize::from(class == LinkClass::InterNode);
            for bytes in msgs {
                let start = self.ports[port].max(Instant::now());
                let end = start + model.link(class).transfer_time(bytes);
                self.ports[port] = end;
                out[j] = Some(end);
            }
        }
        out
    }

    /// The window a member's post lends to its peers.
    fn lent<'a>(call: &DeviceCall<'a, D>, index: usize) -> Option<View<'a, D>> {
        match *call {
            DeviceCall::AllGather { send, .. }
            | DeviceCall::AllToAll { send, .. }
            | DeviceCall::AllToAllV { send, .. }
            | DeviceCall::ReduceScatterF32 { send, .. } => Some(send),
            DeviceCall::AllReduceF32 { buf } => Some(buf),
            DeviceCall::Broadcast { root, buf } => (root == index).then_some(buf),
            DeviceCall::Barrier => None,
        }
    }

    /// Checks that every member called the same thing with consistent sizes.
    fn agree(posts: &[Arc<Post<D>>], index: usize, call: &DeviceCall<'_, D>) -> Result<(), CommError> {
        let p = call.primitive();
        let mine =
            posts.get(index).ok_or_else(|| CommError::Mismatch(format!("{p}: no post of member {index}")))?;
        for (j, other) in posts.iter().enumerate() {
            if other.kind != p {
                return Err(CommError::Mismatch(format!("{p}: member {j} called {} instead", other.kind)));
            }
            let same_bytes = !matches!(call, DeviceCall::AllToAllV { .. } | DeviceCall::Barrier);
            if same_bytes && other.bytes != mine.bytes {
                return Err(CommError::Mismatch(format!(
                    "{p}: member {j} passed {} bytes, member {index} {}",
                    other.bytes, mine.bytes
                )));
            }
            if other.root != mine.root {
                return Err(CommError::Mismatch(format!(
                    "{p}: member {j} named root {}, member {index} root {}",
                    other.root, mine.root
                )));
            }
            if let DeviceCall::AllToAllV { recv_counts, .. } = call {
                let sent = other.counts.get(index).copied().unwrap_or(0);
                let expected = recv_counts.get(j).copied().unwrap_or(0);
                if sent != expected {
                    return Err(CommError::Mismatch(format!(
                        "{p}: member {j} sends {sent} bytes to member {index}, which expects {expected}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Member `index`'s reads of its peers' posts, on its stream.
    fn reads(
        &self,
        posts: &[Arc<Post<D>>],
        index: usize,
        call: &DeviceCall<'_, D>,
        scratch: Option<&DeviceBuf<D>>,
    ) -> Result<(), CommError> {
        let (dev, s) = (&self.device, &self.stream);
        let g = posts.len();
        let lent = |j: usize| -> Result<View<'_, D>, CommError> {
            let post = posts.get(j).ok_or_else(|| CommError::Mismatch(format!("no post of member {j}")))?;
            if let Some(e) = &post.ready {
                dev.wait(s, e)?;
            }
            match &post.buf {
                Some((b, off, len)) => b.slice(*off, *len),
                None => Err(CommError::Mismatch(format!("member {j} lent no buffer"))),
            }
        };
        match *call {
            DeviceCall::AllGather { send, recv } => {
                for j in 0..g {
                    dev.copy(s, lent(j)?, recv.chunk(j, send.len())?)?;
                }
            }
            DeviceCall::AllToAll { send, recv } => {
                let c = send.len() / g.max(1);
                for j in 0..g {
                    dev.copy(s, lent(j)?.chunk(index, c)?, recv.chunk(j, c)?)?;
                }
            }
            DeviceCall::AllToAllV { recv, recv_counts, .. } => {
                let mut at = 0;
                for (j, &n) in recv_counts.iter().enumerate() {
                    let post =
                        posts.get(j).ok_or_else(|| CommError::Mismatch(format!("no post of member {j}")))?;
                    let from: usize = post.counts.iter().take(index).sum();
                    dev.copy(s, lent(j)?.slice(from, n)?, recv.slice(at, n)?)?;
                    at += n;
                }
            }
            DeviceCall::ReduceScatterF32 { recv, .. } => {
                dev.zero(s, recv)?;
                for j in 0..g {
                    let src = lent(j)?.chunk(index, recv.len())?;
                    dev.kernel(s, Kernel::Add { src, elem: Elem::F32, dst: recv })?;
                }
            }
            DeviceCall::AllReduceF32 { .. } => {
                let tmp =
                    scratch.ok_or_else(|| CommError::Mismatch("all_reduce: no scratch buffer".into()))?;
                for j in 0..g {
                    dev.kernel(s, Kernel::Add { src: lent(j)?, elem: Elem::F32, dst: tmp.view() })?;
                }
            }
            DeviceCall::Broadcast { root, buf } => {
                if root != index {
                    dev.copy(s, lent(root)?, buf)?;
                }
            }
            DeviceCall::Barrier => {}
        }
        Ok(())
    }
}

impl<D: Device> DeviceCommunicator for DeviceComm<D> {
    type Device = D;

    device_getters!();

    fn duplicate(&mut self) -> Result<Self, CommError> {
        self.dup()
    }

    fn quant_timer(&self) -> Option<&QuantTimer> {
        self.timer.as_deref()
    }

    fn raw(&mut self, group: &Group, index: usize, call: DeviceCall<'_, D>) -> Result<(), CommError> {
        let p = call.primitive();
        let seq = self.seqs.entry(group.ranks().to_vec()).or_insert(0);
        let key: Key = (self.path.clone(), group.ranks().to_vec(), *seq);
        *seq += 1;
        let (bytes, counts, root) = match call {
            DeviceCall::AllGather { send, .. }
            | DeviceCall::AllToAll { send, .. }
            | DeviceCall::ReduceScatterF32 { send, .. } => (send.len(), Vec::new(), 0),
            DeviceCall::AllToAllV { send, send_counts, .. } => (send.len(), send_counts.to_vec(), 0),
            DeviceCall::AllReduceF32 { buf } => (buf.len(), Vec::new(), 0),
            DeviceCall::Broadcast { root, buf } => (buf.len(), Vec::new(), root),
            DeviceCall::Barrier => (0, Vec::new(), 0),
        };
        let buf = Self::lent(&call, index).map(|v| (v.buf().clone(), v.offset(), v.len()));
        let ready = Some(self.device.record(&self.stream)?);
        let arrive = self.arrivals(group, index, &call);
        let post = Post { kind: p, bytes, counts, root, buf, ready, arrive };
        let posts = self.rdv.post(&key, index, post)?;
        let scratch = match call {
            DeviceCall::AllReduceF32 { buf } => Some(DeviceBuf::zeroed(&self.device, buf.len())),
            _ => None,
        }
        .transpose();
        let outcome = scratch.and_then(|scratch| {
            Self::agree(&posts, index, &call)?;
            // Link model: this member's messages have arrived.
            if let Some(last) = posts.iter().filter_map(|q| q.arrive.get(index).copied().flatten()).max() {
                let now = Instant::now();
                if last > now {
                    std::thread::sleep(last - now);
                }
            }
            self.reads(&posts, index, &call, scratch.as_ref())?;
            Ok(scratch)
        });
        // Phase 2 always runs, so no peer waits for a member that failed.
        let done = self.device.record(&self.stream)?;
        let events = self.rdv.finish(&key, index, p, Some(done))?;
        drop(posts);
        let scratch = outcome?;
        for e in &events {
            self.device.wait(&self.stream, e)?;
        }
        if let (DeviceCall::AllReduceF32 { buf }, Some(tmp)) = (call, scratch) {
            self.device.copy(&self.stream, tmp.view(), buf)?;
        }
        Ok(())
    }
}
