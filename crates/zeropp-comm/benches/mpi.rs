//! MPI backend overhead: the collectives through [`MpiComm`] next to the same raw
//! MPI calls (rsmpi directly), in the same run, timed with `MPI_Wtime`.
//!
//! `cargo bench -p zeropp-comm --bench mpi --features mpi` (or `cargo xtask bench
//! mpi`) starts this binary without MPI; it then relaunches itself under
//! `mpirun -np 8 --oversubscribe` (`ZEROPP_MPI_BENCH_NP` changes the count). Rank 0
//! prints a markdown table and writes it to `target/bench-report/mpi.md`
//! (`ZEROPP_BENCH_REPORT_DIR` changes the folder).
//!
//! Each row times one collective with a per-rank payload of the given size:
//! all-gather (`size` sent, `np · size` received), all-to-all (`size` sent in `np`
//! chunks) and sum-reduce-scatter of `f32` (`size` sent, `size / np` received).
//! Variants are interleaved round by round; a round's time is the slowest rank's
//! mean over its iterations, and the table gives the median round.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::topology::Color;
use mpi::topology::{Communicator as _, SimpleCommunicator};
use zeropp_comm::collectives::{QgzOptions, qgz_reduce_scatter, shard_len};
use zeropp_comm::mpi::{Mpi, MpiComm, MpiOptions, Reduction};
use zeropp_comm::{CommError, Communicator, Group};

const SIZES: &[(usize, &str)] = &[(64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB")];
const ROUNDS: usize = 5;

#[derive(Clone, Copy, PartialEq)]
enum Op {
    AllGather,
    AllToAll,
    /// `MpiComm` with `Reduction::Native` against `MPI_Reduce_scatter_block`.
    ReduceScatter,
    /// `MpiComm`'s default `Reduction::Ordered` against `MPI_Reduce_scatter_block`.
    ReduceScatterOrdered,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all-gather",
            Op::AllToAll => "all-to-all",
            Op::ReduceScatter => "reduce-scatter f32 (native)",
            Op::ReduceScatterOrdered => "reduce-scatter f32 (ordered, default)",
        }
    }

    fn floats(self) -> bool {
        matches!(self, Op::ReduceScatter | Op::ReduceScatterOrdered)
    }
}

struct Buffers {
    send: Vec<u8>,
    recv: Vec<u8>,
    fsend: Vec<f32>,
    frecv: Vec<f32>,
}

impl Buffers {
    fn new(op: Op, size: usize, np: usize) -> Self {
        let recv_len = match op {
            Op::AllGather => size * np,
            Op::AllToAll => size,
            Op::ReduceScatter | Op::ReduceScatterOrdered => 0,
        };
        let floats = if op.floats() { size / 4 } else { 0 };
        Self {
            send: (0..if op.floats() { 0 } else { size }).map(|i| i as u8).collect(),
            recv: vec![0u8; recv_len],
            fsend: (0..floats).map(|i| (i % 97) as f32).collect(),
            frecv: vec![0.0f32; floats / np],
        }
    }
}

fn raw_call(raw: &SimpleCommunicator, op: Op, b: &mut Buffers) {
    match op {
        Op::AllGather => raw.all_gather_into(&b.send[..], &mut b.recv[..]),
        Op::AllToAll => raw.all_to_all_into(&b.send[..], &mut b.recv[..]),
        Op::ReduceScatter | Op::ReduceScatterOrdered => {
            raw.reduce_scatter_block_into(&b.fsend[..], &mut b.frecv[..], SystemOperation::sum())
        }
    }
}

fn comm_call(comm: &mut MpiComm, world: &Group, op: Op, b: &mut Buffers) -> Result<(), CommError> {
    match op {
        Op::AllGather => comm.all_gather_bytes(world, &b.send, &mut b.recv),
        Op::AllToAll => comm.all_to_all_bytes(world, &b.send, &mut b.recv),
        Op::ReduceScatter | Op::ReduceScatterOrdered => {
            comm.reduce_scatter_f32(world, &b.fsend, &mut b.frecv)
        }
    }
}

/// The communication of qgZ (two all-to-alls: intra-node, then the rail) with the
/// chunk sizes one `qgz_reduce_scatter` of `floats` gradient elements puts on the
/// wire, read from the traffic counters.
struct QgzPattern {
    intra_chunk: usize,
    inter_chunk: usize,
}

fn qgz_pattern(comm: &mut MpiComm, floats: usize) -> Result<(QgzPattern, Vec<f32>), CommError> {
    let topo = *comm.topology();
    let grad: Vec<f32> = (0..floats).map(|i| ((i * 7 + comm.rank()) % 13) as f32 / 13.0).collect();
    let mut shard = vec![0.0f32; shard_len(floats, topo.world())];
    comm.traffic_mut().reset();
    qgz_reduce_scatter(comm, &grad, &mut shard, &QgzOptions::default())?;
    let t = comm.traffic().snapshot().total();
    let (l, n) = (topo.local_size(), topo.nodes());
    let intra_chunk = if l > 1 { (t.intra.bytes_sent / (l as u64 - 1)) as usize } else { 0 };
    let inter_chunk = if n > 1 { (t.inter.bytes_sent / (n as u64 - 1)) as usize } else { 0 };
    Ok((QgzPattern { intra_chunk, inter_chunk }, grad))
}

/// Seconds per iteration of the slowest rank.
fn time(
    raw: &SimpleCommunicator,
    iters: usize,
    mut f: impl FnMut() -> Result<(), CommError>,
) -> Result<f64, CommError> {
    f()?; // warm-up
    raw.barrier();
    let t0 = mpi::time();
    for _ in 0..iters {
        f()?;
    }
    let mine = (mpi::time() - t0) / iters as f64;
    let mut slowest = 0.0f64;
    raw.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
    Ok(slowest)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn fmt_s(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

fn report_dir() -> PathBuf {
    std::env::var_os("ZEROPP_BENCH_REPORT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-report"))
}

fn bench() -> Result<(), CommError> {
    let mpi = Mpi::init()?;
    let mut checked = mpi.communicator(MpiOptions::default())?;
    let mut unchecked = mpi.communicator(MpiOptions::default().with_check_sizes(false))?;
    let native = MpiOptions::default().with_reduction(Reduction::Native);
    let mut checked_native = mpi.communicator(native.clone())?;
    let mut unchecked_native = mpi.communicator(native.with_check_sizes(false))?;
    let raw = SimpleCommunicator::world().duplicate();
    let np = checked.topology().world();
    let world = Group::world(checked.topology());
    let rank = checked.rank();

    let mut md = String::new();
    let _ = writeln!(md, "# bench `mpi`\n");
    let _ = writeln!(
        md,
        "`MpiComm` against the same raw MPI call (rsmpi) in the same run, {np} ranks, {} hardware threads \
         (heavily oversubscribed when ranks > threads: absolute times are dominated by scheduling and \
         memory bandwidth; the ratios are what matters). MPI thread level: {}. Median of {ROUNDS} interleaved \
         rounds, each the slowest rank's mean. Ratio = MpiComm time / raw time (target <= 1.10 for >= 1 MiB).\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        mpi.thread_level()
    );
    let _ = writeln!(
        md,
        "| collective | per-rank payload | raw MPI | MpiComm | ratio | MpiComm, no size check | ratio |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for op in [Op::AllGather, Op::AllToAll, Op::ReduceScatter, Op::ReduceScatterOrdered] {
        for &(size, label) in SIZES {
            let iters = if size >= 16 << 20 {
                4
            } else if size >= 1 << 20 {
                10
            } else {
                50
            };
            let mut b = Buffers::new(op, size, np);
            let (mut t_raw, mut t_chk, mut t_unc) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                t_raw.push(time(&raw, iters, || {
                    raw_call(&raw, op, &mut b);
                    Ok(())
                })?);
                let (chk, unc) = if op == Op::ReduceScatter {
                    (&mut checked_native, &mut unchecked_native)
                } else {
                    (&mut checked, &mut unchecked)
                };
                t_chk.push(time(&raw, iters, || comm_call(chk, &world, op, &mut b))?);
                t_unc.push(time(&raw, iters, || comm_call(unc, &world, op, &mut b))?);
            }
            let (r, c, u) = (median(t_raw), median(t_chk), median(t_unc));
            let _ = writeln!(
                md,
                "| {} | {label} | {} | {} | {:.2}x | {} | {:.2}x |",
                op.name(),
                fmt_s(r),
                fmt_s(c),
                c / r,
                fmt_s(u),
                u / r
            );
        }
    }
    // qgZ: its two all-to-alls through MpiComm against the same raw MPI_Alltoall
    // calls (backend overhead), and the whole qgz_reduce_scatter (with quantization).
    let topo = *checked.topology();
    let node = raw
        .split_by_color_with_key(Color::with_value(topo.node_of(rank) as i32), rank as i32)
        .ok_or_else(|| CommError::InvalidConfig("node split failed".into()))?;
    let rail = raw
        .split_by_color_with_key(Color::with_value(topo.local_rank(rank) as i32), rank as i32)
        .ok_or_else(|| CommError::InvalidConfig("rail split failed".into()))?;
    let (g_node, g_rail) = (Group::intra_node(&topo, rank), Group::rail(&topo, rank));
    let _ = writeln!(
        md,
        "\nqgZ ({} nodes x {} ranks; gradient of the given size per rank): the two INT4 all-to-alls \
         (intra-node, then rail) with the chunk sizes qgZ uses, raw vs MpiComm; last column: the whole \
         `qgz_reduce_scatter` through MpiComm, quantization kernels included.\n",
        topo.nodes(),
        topo.local_size()
    );
    let _ = writeln!(
        md,
        "| gradient | raw 2x MPI_Alltoall | MpiComm | ratio | MpiComm, no size check | ratio | full qgZ |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for &(size, label) in SIZES.iter().skip(1) {
        let iters = if size >= 16 << 20 { 4 } else { 10 };
        let (pat, grad) = qgz_pattern(&mut checked, size / 4)?;
        let (li, ln) = (g_node.size(), g_rail.size());
        let (s1, mut r1) = (vec![1u8; pat.intra_chunk * li], vec![0u8; pat.intra_chunk * li]);
        let (s2, mut r2) = (vec![2u8; pat.inter_chunk * ln], vec![0u8; pat.inter_chunk * ln]);
        let mut shard = vec![0.0f32; shard_len(grad.len(), topo.world())];
        let (mut t_raw, mut t_chk, mut t_unc, mut t_full) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            t_raw.push(time(&raw, iters, || {
                node.all_to_all_into(&s1[..], &mut r1[..]);
                rail.all_to_all_into(&s2[..], &mut r2[..]);
                Ok(())
            })?);
            for (c, out) in [(&mut checked, &mut t_chk), (&mut unchecked, &mut t_unc)] {
                out.push(time(&raw, iters, || {
                    c.all_to_all_bytes(&g_node, &s1, &mut r1)?;
                    c.all_to_all_bytes(&g_rail, &s2, &mut r2)
                })?);
            }
            t_full.push(time(&raw, iters, || {
                qgz_reduce_scatter(&mut checked, &grad, &mut shard, &QgzOptions::default())
            })?);
        }
        let (r, c, u, f) = (median(t_raw), median(t_chk), median(t_unc), median(t_full));
        let _ = writeln!(
            md,
            "| {label} | {} | {} | {:.2}x | {} | {:.2}x | {} |",
            fmt_s(r),
            fmt_s(c),
            c / r,
            fmt_s(u),
            u / r,
            fmt_s(f)
        );
    }
    drop((node, rail));
    if rank == 0 {
        println!("{md}");
        let dir = report_dir();
        let out = dir.join("mpi.md");
        match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&out, &md)) {
            Ok(()) => println!("wrote {}", out.display()),
            Err(e) => eprintln!("could not write {}: {e}", out.display()),
        }
    }
    drop(raw);
    Ok(())
}

/// True when this process was started by an MPI launcher.
fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

fn relaunch() -> ExitCode {
    let np = std::env::var("ZEROPP_MPI_BENCH_NP").unwrap_or_else(|_| "8".into());
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("mpi bench: cannot find its own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Two simulated nodes by default, so qgZ has both an intra-node and a rail hop.
    let half = np.parse::<usize>().map_or(1, |n| (n / 2).max(1)).to_string();
    let local = std::env::var("ZEROPP_LOCAL_SIZE").unwrap_or(half);
    let status = Command::new("mpirun")
        .args(["-np", &np, "--oversubscribe"])
        .arg(&exe)
        .env("ZEROPP_LOCAL_SIZE", local)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("mpi bench: mpirun failed ({s})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("mpi bench: cannot start mpirun (install openmpi-bin): {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    if !under_mpirun() {
        // `cargo bench` passes `--bench`; `cargo test --benches` does not: skip the
        // (minutes long) measurement there.
        if !std::env::args().any(|a| a == "--bench") {
            println!("mpi bench: skipped (run it with `cargo bench --bench mpi --features mpi`)");
            return ExitCode::SUCCESS;
        }
        return relaunch();
    }
    zeropp_comm::mpi::or_abort(bench);
    ExitCode::SUCCESS
}
