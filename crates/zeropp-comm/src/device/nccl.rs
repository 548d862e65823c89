//! [`NcclComm`] (feature `nccl`): the [`DeviceCommunicator`] primitives on
//! NVIDIA's NCCL, one process (or thread) per GPU.
//!
//! # Loading
//!
//! `libnccl.so.2` is opened at run time with `libloading` (`dlopen`), so nothing
//! NCCL is needed to build or link: the library comes from the system, from
//! `LD_LIBRARY_PATH`, or from NVIDIA's `nvidia-nccl-cu12` wheel
//! (`site-packages/nvidia/nccl/lib`, or `dist-packages/…` where Debian's and
//! Ubuntu's Python put a root `pip install`, as in most CUDA containers), or
//! from the path in `ZEROPP_NCCL_LIB`.
//! `libloading` over `cudarc`'s NCCL bindings: we call eight functions with
//! plain C types; cudarc would bring a second CUDA binding next to `cust` (its
//! own context and stream types), for no gain.
//!
//! # Bootstrap
//!
//! [`NcclComm::new`] is collective over any host [`Communicator`] of the job:
//! rank 0 makes the NCCL unique id and broadcasts it on that communicator, and
//! every rank calls `ncclCommInitRank`. Under `mpirun` that communicator is the
//! MPI backend (feature `mpi`, [`crate::Mpi`]); in one process it can be a
//! [`ThreadCluster`](crate::ThreadCluster) rank, one GPU per thread: give each
//! rank its own device with [`CudaDevice::for_local_rank`] (NCCL refuses two
//! ranks of one communicator on the same GPU).
//!
//! # Collectives
//!
//! Every primitive runs on any [`Group`] of the world communicator as grouped
//! `ncclSend`/`ncclRecv` between the members (no communicator per group, so no
//! world-wide agreement is needed to use a new group), on the rank's stream.
//! Reductions receive the members' chunks and sum them with the device's add
//! kernel in group order from zero, so results are bitwise those of the thread
//! backend (as the MPI backend's `Reduction::Ordered`), at the cost of `g` chunk
//! buffers instead of NCCL's ring. Arguments are checked and traffic counted by
//! [`DeviceCommunicator`]'s provided methods, as on every backend.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;

use super::cuda::CudaStream;
use super::{CudaDevice, Device, DeviceBuf, DeviceCall, DeviceCommunicator, Elem, Kernel, View};
use crate::{CommError, Communicator, Group, Topology, TrafficCounter};

type NcclResult = c_int;
type NcclCommPtr = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// `ncclUint8` (all data moves as bytes).
const NCCL_UINT8: c_int = 1;

/// The NCCL entry points this module uses, resolved from one loaded library.
struct Api {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut NcclCommPtr, c_int, UniqueId, c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(NcclCommPtr) -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclCommPtr, *mut c_void) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclCommPtr, *mut c_void) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    /// Keeps the library mapped while the function pointers above are used.
    _lib: libloading::Library,
}

fn load_error(what: String) -> CommError {
    CommError::Device { api: "nccl", code: -1, what }
}

/// Where `libnccl.so.2` may be: `ZEROPP_NCCL_LIB`, the loader's own search, then
/// the `nvidia-nccl-cu12` wheel of the Python environments next to `PATH`'s
/// directories and of the system Pythons ([`wheel_candidates`]).
fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("ZEROPP_NCCL_LIB") {
        v.push(PathBuf::from(p));
    }
    v.push(PathBuf::from("libnccl.so.2"));
    v.push(PathBuf::from("libnccl.so"));
    let mut prefixes: Vec<PathBuf> =
        std::env::var_os("PATH").iter().flat_map(std::env::split_paths).map(|d| d.join("..")).collect();
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    v.extend(wheel_candidates(&prefixes));
    v
}

/// The NCCL wheel's library under every `PREFIX/lib/python3*/{site,dist}-packages`
/// of `prefixes` that exists (`site-packages` for venvs and pip's own Pythons,
/// `dist-packages` for Debian's and Ubuntu's, where a root `pip install` lands).
fn wheel_candidates(prefixes: &[PathBuf]) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let lib = py.join(packages).join("nvidia/nccl/lib/libnccl.so.2");
                if lib.exists() {
                    v.push(lib);
                }
            }
        }
    }
    v
}

impl Api {
    fn load() -> Result<Api, CommError> {
        let mut tried = Vec::new();
        for path in candidates() {
            // SAFETY: loading NCCL runs its (well-behaved) initializers; the
            // library is kept mapped in `_lib` for as long as the pointers live.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => return Self::resolve(lib),
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(load_error(format!("libnccl.so.2 not found (set ZEROPP_NCCL_LIB); tried {}", tried.join("; "))))
    }

    fn resolve(lib: libloading::Library) -> Result<Api, CommError> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's C function of that name, whose
                // signature (nccl.h, stable since NCCL 2.7) the field's type spells.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| load_error(format!("{}: {e}", $name)))?
            };
        }
        Ok(Api {
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_destroy: sym!("ncclCommDestroy"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            error_string: sym!("ncclGetErrorString"),
            version: sym!("ncclGetVersion"),
            _lib: lib,
        })
    }

    fn check(&self, r: NcclResult, what: &str) -> Result<(), CommError> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let msg = unsafe {
            let p = (self.error_string)(r);
            if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() }
        };
        Err(CommError::Device { api: "nccl", code: r, what: format!("{what}: {msg}") })
    }
}

/// The NCCL communicator handle, destroyed once.
struct Handle {
    api: Arc<Api>,
    comm: NcclCommPtr,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it are
// not concurrent; `NcclComm` owns its handle and takes `&mut self` for every call.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once.
        let _ = unsafe { (self.api.comm_destroy)(self.comm) };
    }
}

/// One rank of an NCCL job on its GPU (see the module docs).
pub struct NcclComm {
    handle: Handle,
    rank: usize,
    topology: Topology,
    device: CudaDevice,
    stream: CudaStream,
    traffic: TrafficCounter,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// Collective over `bootstrap`'s world: loads NCCL, shares a unique id from
    /// rank 0 over `bootstrap` and creates the NCCL communicator (same ranks and
    /// topology as `bootstrap`) on `device` (this process's GPU 0: give each rank
    /// its own GPU with `CUDA_VISIBLE_DEVICES`).
    pub fn new<C: Communicator + ?Sized>(
        bootstrap: &mut C,
        device: CudaDevice,
    ) -> Result<NcclComm, CommError> {
        let api = Arc::new(Api::load()?);
        let topology = *bootstrap.topology();
        let rank = bootstrap.rank();
        let mut id = UniqueId { internal: [0; 128] };
        if rank == 0 {
            // SAFETY: `id` is a valid out-pointer.
            api.check(unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        }
        let mut bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        bootstrap.broadcast_bytes(&Group::world(&topology), 0, &mut bytes)?;
        for (d, s) in id.internal.iter_mut().zip(&bytes) {
            *d = *s as c_char;
        }
        let stream = device.stream()?;
        stream.gpu().make_current()?;
        let (world, me) = (c_int::try_from(topology.world()), c_int::try_from(rank));
        let (Ok(world), Ok(me)) = (world, me) else {
            return Err(load_error(format!("world {} too large for NCCL", topology.world())));
        };
        let mut comm: NcclCommPtr = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; every rank passes the same id
        // and world size and its own rank; the CUDA context is current.
        api.check(unsafe { (api.comm_init_rank)(&mut comm, world, id, me) }, "ncclCommInitRank")?;
        Ok(NcclComm {
            handle: Handle { api, comm },
            rank,
            topology,
            device,
            stream,
            traffic: TrafficCounter::new(topology, rank),
        })
    }

    /// The loaded NCCL's version code (e.g. 22105 for 2.21.5).
    pub fn nccl_version(&self) -> Result<i32, CommError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        self.handle.api.check(unsafe { (self.handle.api.version)(&mut v) }, "ncclGetVersion")?;
        Ok(v)
    }

    fn addr(v: View<'_, CudaDevice>) -> *mut c_void {
        (v.mem().device_addr() + v.offset() as u64) as usize as *mut c_void
    }

    /// One grouped round of sends and receives (`(peer rank, window)` each).
    fn exchange(
        &self,
        sends: &[(usize, View<'_, CudaDevice>)],
        recvs: &[(usize, View<'_, CudaDevice>)],
    ) -> Result<(), CommError> {
        let api = &self.handle.api;
        let stream = self.stream.gpu().stream().as_inner() as *mut c_void;
        self.stream.gpu().make_current()?;
        // SAFETY: NCCL group calls; every window is live device memory of its
        // length (views are checked against their buffers), peers are world
        // ranks (group members), and the stream belongs to the current context.
        unsafe {
            api.check((api.group_start)(), "ncclGroupStart")?;
            let mut result = Ok(());
            for &(peer, v) in sends {
                let r =
                    (api.send)(Self::addr(v), v.len(), NCCL_UINT8, peer as c_int, self.handle.comm, stream);
                result = result.and(api.check(r, "ncclSend"));
            }
            for &(peer, v) in recvs {
                let r =
                    (api.recv)(Self::addr(v), v.len(), NCCL_UINT8, peer as c_int, self.handle.comm, stream);
                result = result.and(api.check(r, "ncclRecv"));
            }
            let end = api.check((api.group_end)(), "ncclGroupEnd");
            result.and(end)
        }
    }

    /// Sums `g` chunks of `chunk` bytes (in `parts`) into `out`, in group order from zero.
    fn sum_parts(
        &self,
        parts: &DeviceBuf<CudaDevice>,
        g: usize,
        out: View<'_, CudaDevice>,
    ) -> Result<(), CommError> {
        let (dev, s) = (&self.device, &self.stream);
        dev.zero(s, out)?;
        for j in 0..g {
            dev.kernel(s, Kernel::Add { src: parts.view().chunk(j, out.len())?, elem: Elem::F32, dst: out })?;
        }
        Ok(())
    }
}

/// Each peer `(group index j, rank)` with chunk `j` of `c` bytes of `v`.
fn chunks<'v>(
    peers: &[(usize, usize)],
    v: View<'v, CudaDevice>,
    c: usize,
) -> Result<Vec<(usize, View<'v, CudaDevice>)>, CommError> {
    peers.iter().map(|&(j, p)| Ok((p, v.chunk(j, c)?))).collect()
}

/// Each peer `(group index, rank)` with all of `v`.
fn whole<'v>(peers: &[(usize, usize)], v: View<'v, CudaDevice>) -> Vec<(usize, View<'v, CudaDevice>)> {
    peers.iter().map(|&(_, p)| (p, v)).collect()
}

impl DeviceCommunicator for NcclComm {
    type Device = CudaDevice;

    device_getters!();

    /// A new NCCL communicator on the same ranks, bootstrapped over this one
    /// (rank 0's unique id broadcast through NCCL itself).
    fn duplicate(&mut self) -> Result<Self, CommError> {
        let api = Arc::clone(&self.handle.api);
        let world = Group::world(&self.topology);
        let me = self.rank;
        let mut id = UniqueId { internal: [0; 128] };
        if me == 0 {
            // SAFETY: `id` is a valid out-pointer.
            api.check(unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        }
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let buf = DeviceBuf::from_bytes(&self.device, &self.stream, &bytes)?;
        self.broadcast(&world, 0, buf.view())?;
        let bytes = buf.to_bytes(&self.device, &self.stream)?;
        for (d, s) in id.internal.iter_mut().zip(&bytes) {
            *d = *s as c_char;
        }
        let stream = self.device.stream()?;
        stream.gpu().make_current()?;
        let mut comm: NcclCommPtr = std::ptr::null_mut();
        let (n, r) = (self.topology.world() as c_int, me as c_int);
        // SAFETY: as in `new`.
        api.check(unsafe { (api.comm_init_rank)(&mut comm, n, id, r) }, "ncclCommInitRank")?;
        Ok(NcclComm {
            handle: Handle { api, comm },
            rank: me,
            topology: self.topology,
            device: self.device.clone(),
            stream,
            traffic: TrafficCounter::new(self.topology, me),
        })
    }

    fn raw(
        &mut self,
        group: &Group,
        index: usize,
        call: DeviceCall<'_, CudaDevice>,
    ) -> Result<(), CommError> {
        let (dev, s) = (self.device.clone(), &self.stream);
        let g = group.size();
        let peers: Vec<(usize, usize)> =
            group.ranks().iter().copied().enumerate().filter(|&(j, _)| j != index).collect();
        match call {
            DeviceCall::AllGather { send, recv } => {
                dev.copy(s, send, recv.chunk(index, send.len())?)?;
                self.exchange(&whole(&peers, send), &chunks(&peers, recv, send.len())?)
            }
            DeviceCall::AllToAll { send, recv } => {
                let c = send.len() / g.max(1);
                dev.copy(s, send.chunk(index, c)?, recv.chunk(index, c)?)?;
                self.exchange(&chunks(&peers, send, c)?, &chunks(&peers, recv, c)?)
            }
            DeviceCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                let at = |counts: &[usize], j: usize| counts.iter().take(j).sum::<usize>();
                let own = send.slice(at(send_counts, index), send_counts.get(index).copied().unwrap_or(0))?;
                dev.copy(s, own, recv.slice(at(recv_counts, index), own.len())?)?;
                let mut sends = Vec::new();
                let mut recvs = Vec::new();
                for &(j, p) in &peers {
                    let (sc, rc) =
                        (send_counts.get(j).copied().unwrap_or(0), recv_counts.get(j).copied().unwrap_or(0));
                    sends.push((p, send.slice(at(send_counts, j), sc)?));
                    recvs.push((p, recv.slice(at(recv_counts, j), rc)?));
                }
                self.exchange(&sends, &recvs)
            }
            DeviceCall::ReduceScatterF32 { send, recv } => {
                let c = recv.len();
                let parts = DeviceBuf::zeroed(&dev, c * g)?;
                dev.copy(s, send.chunk(index, c)?, parts.view().chunk(index, c)?)?;
                self.exchange(&chunks(&peers, send, c)?, &chunks(&peers, parts.view(), c)?)?;
                self.sum_parts(&parts, g, recv)
            }
            DeviceCall::AllReduceF32 { buf } => {
                let c = buf.len();
                let parts = DeviceBuf::zeroed(&dev, c * g)?;
                dev.copy(s, buf, parts.view().chunk(index, c)?)?;
                self.exchange(&whole(&peers, buf), &chunks(&peers, parts.view(), c)?)?;
                self.sum_parts(&parts, g, buf)
            }
            DeviceCall::Broadcast { root, buf } => {
                let root_rank =
                    group.rank_at(root).ok_or_else(|| CommError::InvalidGroup(format!("root {root}")))?;
                if index == root {
                    self.exchange(&whole(&peers, buf), &[])
                } else {
                    self.exchange(&[], &[(root_rank, buf)])
                }
            }
            DeviceCall::Barrier => {
                // One byte to and from every other member, then wait for the stream.
                let token = DeviceBuf::zeroed(&dev, g.max(1))?;
                let one = token.view().chunk(index, 1)?;
                self.exchange(&whole(&peers, one), &chunks(&peers, token.view(), 1)?)?;
                dev.synchronize(s)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::wheel_candidates;

    /// The wheel is found under `site-packages` and under Debian's
    /// `dist-packages`, and nothing is listed where no library exists.
    #[test]
    fn the_wheel_is_found_in_site_and_dist_packages() {
        let root = std::env::temp_dir().join(format!("zeropp-nccl-{}", std::process::id()));
        let mk = |p: &str| {
            let lib = root.join(p).join("nvidia/nccl/lib");
            std::fs::create_dir_all(&lib).map(|()| lib.join("libnccl.so.2"))
        };
        let site = mk("venv/lib/python3.11/site-packages").and_then(|f| std::fs::write(&f, b"").map(|()| f));
        let dist = mk("usr/lib/python3.10/dist-packages").and_then(|f| std::fs::write(&f, b"").map(|()| f));
        let empty = mk("usr/lib/python3.12/dist-packages");
        let (Ok(site), Ok(dist), Ok(_)) = (site, dist, empty) else {
            panic!("cannot create the test tree under {}", root.display());
        };
        let found = wheel_candidates(&[root.join("venv"), root.join("usr"), root.join("nowhere")]);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(found, vec![site, dist]);
    }
}
