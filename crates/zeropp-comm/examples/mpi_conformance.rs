//! MPI conformance test: run under `mpirun -np N` (see `xtask/mpi-tests.sh`).
//!
//! 1. The crate's backend-independent suite, [`zeropp_comm::conformance::run_all`],
//!    unchanged, for several lengths (primitives, baselines, qwZ, qgZ, duplicate +
//!    async) on the default `MpiComm` (group-order reductions).
//! 2. Extra MPI checks: every primitive on several groups (world, node, rail, a
//!    reordered and a partial group) against a sequential reference, with
//!    `Reduction::Native` (exact data) and `Reduction::Ordered` (order-sensitive
//!    data, bit-exact); the traffic counters against the thread backend running the
//!    same workload in-process; size mismatches across ranks; every kind of bad
//!    argument, which must give the thread backend's exact errors
//!    ([`zeropp_comm::conformance::check_argument_errors`]); the topology (with
//!    `ZEROPP_LOCAL_SIZE`); a duplicated communicator on a second thread.
//!
//! Rank 0 prints `mpi_conformance: N checks passed`; any failure aborts the job
//! with a non-zero exit.

use zeropp_comm::mpi::{Mpi, MpiOptions, Reduction, ThreadLevel};
use zeropp_comm::{
    CommError, CommExt, Communicator, Group, ThreadCluster, ThreadOptions, Topology, TrafficSnapshot,
    conformance,
};

type Check = Result<(), String>;

fn fail<T>(msg: impl Into<String>) -> Result<T, String> {
    Err(msg.into())
}

fn ctx<T>(what: &str, r: Result<T, CommError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Deterministic payload of `len` bytes keyed by `(a, b, salt)`.
fn bytes(a: usize, b: usize, salt: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (a * 131 + b * 31 + salt * 17 + i * 7 + (i >> 8)) as u8).collect()
}

/// Exactly representable values (multiples of 1/8, small), so any summation order is exact.
fn exact(a: usize, b: usize, e: usize) -> f32 {
    (((a * 7 + b * 3 + e * 5) % 61) as f32 - 30.0) * 0.125
}

/// Values whose sum depends on the order (for the bit-exact `Ordered` mode).
fn inexact(a: usize, b: usize, e: usize) -> f32 {
    ((a * 1_000_003 + b * 7919 + e * 104_729) as f32 * 0.618_034).sin() * 1e3 + 1e-3 * e as f32
}

/// The groups this rank takes part in (all ranks compute the same list, so the
/// collectives line up): world, node, rail, the world reversed, the even ranks.
fn groups(topo: &Topology, rank: usize) -> Vec<(&'static str, Group)> {
    let mut out = vec![
        ("world", Group::world(topo)),
        ("node", Group::intra_node(topo, rank)),
        ("rail", Group::rail(topo, rank)),
    ];
    if let Ok(g) = Group::new(topo, (0..topo.world()).rev().collect()) {
        out.push(("reversed", g));
    }
    if rank.is_multiple_of(2)
        && let Ok(g) = Group::new(topo, (0..topo.world()).step_by(2).collect())
    {
        out.push(("even", g));
    }
    out
}

const SIZES: &[usize] = &[0, 1, 5, 64, 1021];

/// The reference sum: element `e` is `Σ x(r, e)` over the members `r` of `g`, in
/// group order from zero.
fn member_sum(g: &Group, len: usize, x: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let mut want = vec![0.0f32; len];
    for &r in g.ranks() {
        for (e, w) in want.iter_mut().enumerate() {
            *w += x(r, e);
        }
    }
    want
}

/// Equal to the bit (so -0.0 differs from 0.0 and NaN payloads count).
fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.iter().map(|x| x.to_bits()).eq(b.iter().map(|x| x.to_bits()))
}

/// The workload whose results and traffic are compared across backends; returns
/// the number of checks that passed.
fn workload<C: Communicator + ?Sized>(
    comm: &mut C,
    values: fn(usize, usize, usize) -> f32,
) -> Result<usize, String> {
    let topo = *comm.topology();
    let me = comm.rank();
    let mut checks = 0;
    for (name, g) in groups(&topo, me) {
        let gs = g.size();
        let i = g.index_of(me).ok_or("not a member")?;
        for (s, &len) in SIZES.iter().enumerate() {
            let what = format!("{name}/{len}");
            // all_gather
            comm.set_op(&format!("all_gather/{name}"));
            let mut recv = vec![0u8; len * gs];
            ctx(&what, comm.all_gather_bytes(&g, &bytes(me, 0, s, len), &mut recv))?;
            let want: Vec<u8> = g.ranks().iter().flat_map(|&r| bytes(r, 0, s, len)).collect();
            if recv != want {
                return fail(format!("all_gather {what}: wrong data"));
            }
            checks += 1;
            // all_to_all
            comm.set_op(&format!("all_to_all/{name}"));
            let send: Vec<u8> = g.ranks().iter().flat_map(|&r| bytes(me, r, s, len)).collect();
            let mut recv = vec![0u8; len * gs];
            ctx(&what, comm.all_to_all_bytes(&g, &send, &mut recv))?;
            let want: Vec<u8> = g.ranks().iter().flat_map(|&r| bytes(r, me, s, len)).collect();
            if recv != want {
                return fail(format!("all_to_all {what}: wrong data"));
            }
            checks += 1;
            // all_to_all_v: member a sends member b `count(a, b)` bytes.
            comm.set_op(&format!("all_to_all_v/{name}"));
            let count = |a: usize, b: usize| (a * 3 + b * 5 + len) % (len + 3);
            let sc: Vec<usize> = (0..gs).map(|j| count(i, j)).collect();
            let rc: Vec<usize> = (0..gs).map(|j| count(j, i)).collect();
            let send: Vec<u8> =
                g.ranks().iter().zip(&sc).flat_map(|(&r, &c)| bytes(me, r, s + 9, c)).collect();
            let mut recv = vec![0u8; rc.iter().sum()];
            ctx(&what, comm.all_to_all_v_bytes(&g, &send, &sc, &mut recv, &rc))?;
            let want: Vec<u8> =
                g.ranks().iter().zip(&rc).flat_map(|(&r, &c)| bytes(r, me, s + 9, c)).collect();
            if recv != want {
                return fail(format!("all_to_all_v {what}: wrong data"));
            }
            checks += 1;
            // reduce_scatter_f32: chunk j of the member with global rank r is values(r, j, e).
            comm.set_op(&format!("reduce_scatter/{name}"));
            let send: Vec<f32> = (0..gs).flat_map(|j| (0..len).map(move |e| values(me, j, e))).collect();
            let mut recv = vec![f32::NAN; len];
            ctx(&what, comm.reduce_scatter_f32(&g, &send, &mut recv))?;
            if !bitwise_eq(&recv, &member_sum(&g, len, |r, e| values(r, i, e))) {
                return fail(format!("reduce_scatter {what}: wrong sums"));
            }
            checks += 1;
            // all_reduce_f32 on member-specific data.
            comm.set_op(&format!("all_reduce/{name}"));
            let mut buf: Vec<f32> = (0..len).map(|e| values(me, 1, e)).collect();
            ctx(&what, comm.all_reduce_f32(&g, &mut buf))?;
            if !bitwise_eq(&buf, &member_sum(&g, len, |r, e| values(r, 1, e))) {
                return fail(format!("all_reduce {what}: wrong sums"));
            }
            checks += 1;
            // broadcast from every root.
            comm.set_op(&format!("broadcast/{name}"));
            for root in 0..gs {
                let root_rank = g.rank_at(root).ok_or("root")?;
                let mut buf = if root == i { bytes(root_rank, 7, s, len) } else { vec![0u8; len] };
                ctx(&what, comm.broadcast_bytes(&g, root, &mut buf))?;
                if buf != bytes(root_rank, 7, s, len) {
                    return fail(format!("broadcast {what} root {root}: wrong data"));
                }
                checks += 1;
            }
        }
        comm.set_op(&format!("barrier/{name}"));
        ctx(name, comm.barrier(&g))?;
        checks += 1;
    }
    Ok(checks)
}

/// Ranks that disagree get an error on every member, and the communicator stays usable.
fn mismatches(comm: &mut dyn Communicator) -> Result<usize, String> {
    let topo = *comm.topology();
    let me = comm.rank();
    let world = Group::world(&topo);
    let w = world.size();
    let mut checks = 0;
    let expect_err = |what: &str, r: Result<(), CommError>| -> Check {
        match r {
            Err(CommError::Mismatch(_)) | Err(CommError::InvalidGroup(_)) => Ok(()),
            Err(e) => fail(format!("{what}: unexpected error {e}")),
            Ok(()) => fail(format!("{what}: rank {me} got Ok for a mismatched collective")),
        }
    };
    // 1. Different chunk lengths.
    let c = if me == 0 { 3 } else { 4 };
    let mut recv = vec![0u8; c * w];
    expect_err("all_gather lengths", comm.all_gather_bytes(&world, &vec![1u8; c], &mut recv))?;
    checks += 1;
    // 2. One rank passes a receive buffer of the wrong size.
    let mut recv = vec![0u8; if me == 1 { 4 * w + 1 } else { 4 * w }];
    expect_err("all_gather local buffer", comm.all_gather_bytes(&world, &[2u8; 4], &mut recv))?;
    checks += 1;
    // 3. all_to_all_v: rank 0 expects one byte too many from rank 1.
    let sc = vec![2usize; w];
    let mut rc = vec![2usize; w];
    if me == 0 {
        rc[1] = 3;
    }
    let mut recv = vec![0u8; rc.iter().sum()];
    expect_err(
        "all_to_all_v counts",
        comm.all_to_all_v_bytes(&world, &vec![5u8; 2 * w], &sc, &mut recv, &rc),
    )?;
    checks += 1;
    // 4. Different broadcast roots.
    let mut buf = [0u8; 8];
    expect_err("broadcast root", comm.broadcast_bytes(&world, usize::from(me == w - 1), &mut buf))?;
    checks += 1;
    // 5. reduce_scatter with different chunk lengths.
    let n = if me == 1 { 2 } else { 3 };
    let mut recv = vec![0.0f32; n];
    expect_err("reduce_scatter lengths", comm.reduce_scatter_f32(&world, &vec![1.0; n * w], &mut recv))?;
    checks += 1;
    // Still usable.
    let mut all = vec![0u32; w];
    ctx("after mismatches", comm.all_gather(&world, &[me as u32], &mut all))?;
    if all != (0..w as u32).collect::<Vec<_>>() {
        return fail("communicator unusable after mismatches");
    }
    Ok(checks + 1)
}

/// The traffic the thread backend records for the same workload on this rank.
fn thread_backend_traffic(topo: Topology, rank: usize) -> Result<TrafficSnapshot, String> {
    let cluster = ThreadCluster::new(topo, ThreadOptions::default());
    let mut snaps = cluster
        .run(|c| workload(c, exact).map(|_| c.traffic().snapshot()))
        .map_err(|e| format!("thread backend run: {e}"))?;
    if rank < snaps.len() { Ok(snaps.swap_remove(rank)) } else { fail("rank outside the thread cluster") }
}

fn run() -> Result<(), String> {
    let mpi = Mpi::init().map_err(|e| e.to_string())?;
    let level = mpi.thread_level();
    let mut checks = 0usize;

    let mut comm = ctx("communicator", mpi.communicator(MpiOptions::default()))?;
    let topo = *comm.topology();
    let me = comm.rank();
    if me == 0 {
        println!(
            "mpi_conformance: world {} local_size {} nodes {}, thread level {level}",
            topo.world(),
            topo.local_size(),
            topo.nodes()
        );
    }

    // Topology: the override from the environment, or one host = one node.
    let expected_local =
        std::env::var("ZEROPP_LOCAL_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(topo.world());
    if topo.local_size() != expected_local || topo.world() != mpi.size() {
        return fail(format!("topology {topo:?}, expected local size {expected_local}"));
    }
    let other = ctx("override", mpi.communicator(MpiOptions::default().with_local_size(1)))?;
    if other.topology().local_size() != 1 {
        return fail("the local_size option did not override the environment");
    }
    drop(other);
    checks += 2;

    // 1. The crate's conformance suite, unchanged.
    for (k, len) in [0usize, 1, 7, 64, 509].into_iter().enumerate() {
        let case = conformance::Case { seed: 1000 + k as u64, len };
        conformance::run_all(&mut comm, &case).map_err(|e| format!("conformance suite, {case:?}: {e}"))?;
        checks += 1;
    }
    comm.traffic_mut().reset();

    // 2. Primitives against the sequential reference (native reductions, exact data).
    let mut native =
        ctx("native", mpi.communicator(MpiOptions::default().with_reduction(Reduction::Native)))?;
    checks += workload(&mut native, exact)?;
    drop(native);
    checks += workload(&mut comm, exact)?;

    // Traffic: identical to the thread backend's for the same workload.
    let mpi_traffic = comm.traffic().snapshot();
    let thread_traffic = thread_backend_traffic(topo, me)?;
    if mpi_traffic != thread_traffic {
        return fail(format!(
            "traffic differs from the thread backend:\nmpi: {mpi_traffic:?}\nthreads: {thread_traffic:?}"
        ));
    }
    if mpi_traffic.by_op.is_empty() && topo.world() > 1 {
        return fail("no traffic recorded");
    }
    checks += 1;

    // Ordered reductions: bit-identical to the group-order sum on order-sensitive data.
    let mut ordered =
        ctx("ordered", mpi.communicator(MpiOptions::default().with_reduction(Reduction::Ordered)))?;
    checks += workload(&mut ordered, inexact)?;
    drop(ordered);

    // Mismatched sizes are errors on every rank.
    checks += mismatches(&mut comm)?;

    // Bad arguments give exactly the thread backend's errors (variant and words),
    // with and without the size-agreement rounds.
    checks += conformance::check_argument_errors(&mut comm).map_err(|e| format!("argument errors: {e}"))?;
    let mut unchecked = ctx("unchecked", mpi.communicator(MpiOptions::default().with_check_sizes(false)))?;
    checks += conformance::check_argument_errors(&mut unchecked)
        .map_err(|e| format!("argument errors (check_sizes off): {e}"))?;
    drop(unchecked);

    // A duplicated communicator on a second thread, concurrently with this one.
    let world = Group::world(&topo);
    let mut dup = ctx("duplicate", comm.duplicate())?;
    if level == ThreadLevel::Multiple {
        let handle = std::thread::spawn(move || -> Result<usize, String> {
            let w = dup.topology().world();
            for k in 0..20u32 {
                let mut all = vec![0u32; w];
                ctx(
                    "dup all_gather",
                    dup.all_gather(&Group::world(dup.topology()), &[k * 100 + dup.rank() as u32], &mut all),
                )?;
                if all.iter().enumerate().any(|(r, &v)| v != k * 100 + r as u32) {
                    return fail("dup all_gather: wrong data");
                }
            }
            Ok(20)
        });
        for k in 0..20 {
            let total = ctx("main all_reduce", comm.all_reduce_scalar_f32(&world, (me + k) as f32))?;
            let w = topo.world();
            if total != (w * (w - 1) / 2 + w * k) as f32 {
                return fail("main all_reduce: wrong sum");
            }
        }
        checks += 20 + handle.join().map_err(|_| "duplicate thread panicked".to_string())??;
    } else {
        ctx("dup barrier", dup.barrier(&world))?;
        checks += 1;
    }

    // Everyone passed? (A failing rank aborts the job through `or_abort` instead.)
    let total = ctx("total", comm.all_reduce_scalar_f32(&world, checks as f32))?;
    if me == 0 {
        println!(
            "mpi_conformance: {} checks passed on {} ranks ({checks} on rank 0)",
            total as u64,
            topo.world()
        );
    }
    Ok(())
}

fn main() {
    zeropp_comm::mpi::or_abort(run);
}
