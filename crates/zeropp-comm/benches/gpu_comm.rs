//! `cargo xtask bench gpu-comm`: the device collectives on the one-device
//! cluster, as ratios measured in the same run:
//!
//! - qgZ reduce-scatter time / bf16-wire baseline reduce-scatter time;
//! - qwZ all-gather time / bf16 all-gather time;
//! - the quantization share of each quantized collective: the time its ranks
//!   spend in the quantization kernels (quantize, dequantize, fused
//!   dequantize-sum-requantize; each timed to completion through a
//!   `QuantTimer`, which adds a synchronization around each) over the ranks'
//!   total time in the collective, measured in a second, timed pass.
//!
//! Two devices: `HostDevice` (host memory, CPU kernels: **host-simulated**, always
//! runs) and, with feature `cuda` and a GPU, `CudaDevice` (all ranks on one GPU).
//! Without a GPU the GPU rows say so (and `ZEROPP_REQUIRE_GPU=1` fails). The
//! report goes to stdout and to `ZEROPP_GPU_COMM_BENCH_OUT` (markdown) when set.
//! `ZEROPP_GPU_COMM_N` sets the gradient length per rank (default 2^20 on the
//! host, 2^26 on a GPU).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench may unwrap

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zeropp_comm::collectives::{QgzOptions, QwzOptions, Reduce, shard_len};
use zeropp_comm::conformance::rank_data;
use zeropp_comm::device::{
    Device, DeviceBuf, DeviceCluster, DeviceComm, DeviceCommunicator, Elem, HostDevice, QuantTimer,
    collectives as dev,
};
use zeropp_comm::{CommError, Group, ThreadOptions, Topology};

/// Times of one configuration (seconds per call, rank 0's wall clock between barriers).
struct Row {
    device: String,
    topology: String,
    n: usize,
    qgz: f64,
    rs_bf16: f64,
    qwz: f64,
    ag_bf16: f64,
    qgz_share: f64,
    qwz_share: f64,
}

#[derive(Clone, Copy)]
enum Op {
    Qgz,
    RsBf16,
    Qwz,
    AgBf16,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Per-call time of `op` over `reps` repetitions (median of rank 0's), and the
/// quantization share when `timer` is set.
fn run_op<D: Device>(
    comm: &mut DeviceComm<D>,
    op: Op,
    n: usize,
    reps: usize,
    timer: Option<Arc<QuantTimer>>,
) -> Result<f64, CommError> {
    let t = *comm.topology();
    let (w, rank) = (t.world(), comm.rank());
    let world = Group::world(&t);
    let d = comm.device().clone();
    let s = shard_len(n, w);
    let grad = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(5, rank, n))?;
    let shard = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(7, rank, s))?;
    let out = DeviceBuf::zeroed(&d, 4 * s * w)?;
    let shard16 = DeviceBuf::zeroed(&d, 2 * s)?;
    let full16 = DeviceBuf::zeroed(&d, 2 * s * w)?;
    let (qgz, qwz) = (QgzOptions::default(), QwzOptions::default());
    let call = |comm: &mut DeviceComm<D>| -> Result<(), CommError> {
        match op {
            Op::Qgz => dev::qgz_reduce_scatter(comm, grad.view(), out.slice(0, 4 * s)?, &qgz),
            Op::RsBf16 => {
                dev::reduce_scatter_bf16_wire(comm, &world, grad.view(), out.slice(0, 4 * s)?, Reduce::Mean)
            }
            Op::Qwz => {
                dev::qwz_all_gather(comm, &world, shard.view(), Elem::F32, out.view(), Elem::F32, &qwz)
            }
            Op::AgBf16 => dev::all_gather_bf16(comm, &world, shard16.view(), full16.view()),
        }
    };
    call(comm)?; // warm-up
    comm.set_quant_timer(timer);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        DeviceCommunicator::barrier(comm, &world)?;
        d.synchronize(comm.stream())?;
        let t0 = Instant::now();
        call(comm)?;
        d.synchronize(comm.stream())?;
        DeviceCommunicator::barrier(comm, &world)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    comm.set_quant_timer(None);
    Ok(median(times))
}

fn measure<D: Device>(device: D, nodes: usize, local: usize, n: usize, reps: usize) -> Result<Row, String> {
    let t = Topology::ranks(nodes * local).per_node(local).map_err(|e| e.to_string())?;
    let w = t.world();
    let cluster = DeviceCluster::new(
        t,
        device.clone(),
        ThreadOptions::default().with_timeout(Duration::from_secs(300)),
    );
    let time = |op: Op| -> Result<f64, String> {
        let v = cluster.run(|comm| run_op(comm, op, n, reps, None)).map_err(|e| e.to_string())?;
        Ok(v.first().copied().unwrap_or(f64::NAN))
    };
    let share = |op: Op| -> Result<f64, String> {
        let timer = Arc::new(QuantTimer::new());
        let t0 = Instant::now();
        let v = cluster
            .run(|comm| run_op(comm, op, n, reps, Some(Arc::clone(&timer))))
            .map_err(|e| e.to_string())?;
        let _ = t0;
        let per_call = v.first().copied().unwrap_or(f64::NAN);
        // Quantization seconds per rank and call over the (timed pass's) call time.
        Ok(timer.total().as_secs_f64() / (w * reps) as f64 / per_call)
    };
    Ok(Row {
        device: device.name(),
        topology: format!("{nodes}x{local}"),
        n,
        qgz: time(Op::Qgz)?,
        rs_bf16: time(Op::RsBf16)?,
        qwz: time(Op::Qwz)?,
        ag_bf16: time(Op::AgBf16)?,
        qgz_share: share(Op::Qgz)?,
        qwz_share: share(Op::Qwz)?,
    })
}

/// The host path's per-call times of qgZ and qwZ (rank 0's median between
/// barriers, as [`run_op`]) on the thread backend, for the same shape, length
/// and options: the baseline the device code on `HostDevice` is compared with.
fn host_path(nodes: usize, local: usize, n: usize, reps: usize) -> Result<(f64, f64), String> {
    let t = Topology::ranks(nodes * local).per_node(local).map_err(|e| e.to_string())?;
    let cluster =
        zeropp_comm::ThreadCluster::new(t, ThreadOptions::default().with_timeout(Duration::from_secs(300)));
    let times = cluster
        .run(|comm| {
            let (w, rank) = (t.world(), comm.rank());
            let world = Group::world(&t);
            let s = shard_len(n, w);
            let (grad, shard) = (rank_data(5, rank, n), rank_data(7, rank, s));
            let (mut out, mut full) = (vec![0f32; s], vec![0f32; s * w]);
            let (qgz, qwz) = (QgzOptions::default(), QwzOptions::default());
            let mut time = |f: &mut dyn FnMut(&mut zeropp_comm::ThreadComm) -> Result<(), CommError>| {
                f(comm)?; // warm-up
                let mut v = Vec::with_capacity(reps);
                for _ in 0..reps {
                    zeropp_comm::Communicator::barrier(comm, &world)?;
                    let t0 = Instant::now();
                    f(comm)?;
                    zeropp_comm::Communicator::barrier(comm, &world)?;
                    v.push(t0.elapsed().as_secs_f64());
                }
                Ok::<_, CommError>(median(v))
            };
            let q = time(&mut |c| zeropp_comm::collectives::qgz_reduce_scatter(c, &grad, &mut out, &qgz))?;
            let a =
                time(&mut |c| zeropp_comm::collectives::qwz_all_gather(c, &world, &shard, &mut full, &qwz))?;
            Ok::<_, CommError>((q, a))
        })
        .map_err(|e| e.to_string())?;
    Ok(times.first().copied().unwrap_or((f64::NAN, f64::NAN)))
}

fn table(rows: &[(String, Row)]) -> String {
    let mut s = String::from(
        "| device | ranks (nodes x local) | gradient floats / rank | qgZ RS / bf16 RS | qwZ AG / bf16 AG | quant share of qgZ | quant share of qwZ | bf16 RS | bf16 AG |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for (label, r) in rows {
        let _ = writeln!(
            s,
            "| {label}: {} | {} | {} | {:.2} | {:.2} | {:.0}% | {:.0}% | {:.2} ms | {:.2} ms |",
            r.device,
            r.topology,
            r.n,
            r.qgz / r.rs_bf16,
            r.qwz / r.ag_bf16,
            100.0 * r.qgz_share,
            100.0 * r.qwz_share,
            1e3 * r.rs_bf16,
            1e3 * r.ag_bf16
        );
    }
    s
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let host_n = env_usize("ZEROPP_GPU_COMM_N").unwrap_or(1 << 20);
    match measure(HostDevice, 2, 2, host_n, 5) {
        Ok(r) => {
            match host_path(2, 2, host_n, 5) {
                Ok((qgz, qwz)) => notes.push(format!(
                    "The host path (the thread backend's collectives on slices, the same plans and kernels) in the \
                     same run: qgZ RS {:.2} ms, qwZ AG {:.2} ms; the device code on `HostDevice` takes {:.2}x and \
                     {:.2}x that (its kernels copy each input out of and each output back into device memory).",
                    1e3 * qgz,
                    1e3 * qwz,
                    r.qgz / qgz,
                    r.qwz / qwz
                )),
                Err(e) => notes.push(format!("host path run failed: {e}")),
            }
            rows.push(("host-simulated".to_string(), r));
        }
        Err(e) => notes.push(format!("host-simulated run failed: {e}")),
    }
    gpu_rows(&mut rows, &mut notes);
    let mut report = String::from("# gpu-comm: device collectives on the one-device cluster\n\n");
    report.push_str(&table(&rows));
    report.push_str(
        "\nTimes are rank 0's median per call between barriers; ratios are to the bf16 baselines of the same run. \
         `host-simulated` runs the same device code on host memory with the CPU kernels (all ranks share the CPU cores), \
         so its ratios describe CPU kernel cost, not a GPU. The quantization share is measured in a second pass that \
         synchronizes around each quantization kernel.\n",
    );
    for n in &notes {
        report.push_str(&format!("\n{n}\n"));
    }
    println!("{report}");
    if let Some(path) = std::env::var_os("ZEROPP_GPU_COMM_BENCH_OUT")
        && let Err(e) = std::fs::write(&path, &report)
    {
        eprintln!("gpu-comm: cannot write {}: {e}", path.to_string_lossy());
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
fn gpu_rows(rows: &mut Vec<(String, Row)>, notes: &mut Vec<String>) {
    let required = std::env::var("ZEROPP_REQUIRE_GPU").is_ok_and(|v| matches!(v.trim(), "1" | "true"));
    match zeropp_comm::device::CudaDevice::new() {
        Ok(d) => {
            let n = env_usize("ZEROPP_GPU_COMM_N").unwrap_or(1 << 26);
            match measure(d, 2, 4, n, 20) {
                Ok(r) => rows.push(("GPU".to_string(), r)),
                Err(e) => {
                    assert!(!required, "GPU run failed: {e}");
                    notes.push(format!("GPU run failed: {e}"));
                }
            }
        }
        Err(e) => {
            assert!(!required, "ZEROPP_REQUIRE_GPU=1 but no usable CUDA device: {e}");
            notes.push(format!("GPU: skipped, no usable CUDA device ({e})."));
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_rows(_: &mut Vec<(String, Row)>, notes: &mut Vec<String>) {
    notes.push(without_cuda());
}

/// The note of a build without the `cuda` feature (compiled in both builds, so
/// CI's one clippy run, which has the feature, lints it).
#[cfg_attr(feature = "cuda", allow(dead_code))]
fn without_cuda() -> String {
    "GPU: not measured (built without the `cuda` feature; run `cargo xtask bench gpu-comm`).".into()
}
