//! NCCL across GPUs under `mpirun` (features `nccl` and `mpi`): one process per
//! GPU, the NCCL communicator bootstrapped over MPI (rank 0's unique id), then
//! every device primitive and the device ZeRO++ collectives (qwZ, hpZ, qgZ) on
//! NCCL, each checked bit for bit against the host collectives run on the MPI
//! backend (group-order reductions, so the thread backend's bits).
//!
//! ```text
//! cargo build --release -p zeropp-comm --features nccl,mpi --example nccl_mpi
//! mpirun -np 2 -x ZEROPP_REQUIRE_GPU=1 target/release/examples/nccl_mpi
//! ```
//!
//! Each process takes the visible GPU of its node-local rank
//! (`CudaDevice::for_local_rank`), so an inherited `CUDA_VISIBLE_DEVICES` stays in
//! force; the ranks agree over MPI that all have a device before the collective
//! `NcclComm::new`, so nobody waits in it for a rank that skipped.
//!
//! (`ZEROPP_LOCAL_SIZE=L` simulates nodes of `L` ranks.) Rank 0 prints
//! `nccl_mpi: N checks passed`; a failure aborts the job. Fewer than two
//! processes, or no GPU, prints one skip line (an error with `ZEROPP_REQUIRE_GPU=1`).

use zeropp_comm::collectives::{QgzOptions, QwzOptions, qgz_reduce_scatter, qwz_all_gather, shard_len};
use zeropp_comm::conformance::rank_data;
use zeropp_comm::device::{CudaDevice, DeviceBuf, DeviceCommunicator, Elem, NcclComm, collectives as dev};
use zeropp_comm::mpi::{Mpi, MpiOptions};
use zeropp_comm::{CommError, CommExt, Communicator, Group};

fn e(what: &'static str) -> impl Fn(CommError) -> String {
    move |err| format!("{what}: {err}")
}

fn up(nc: &NcclComm, x: &[f32]) -> Result<DeviceBuf<CudaDevice>, String> {
    DeviceBuf::from_f32(nc.device(), nc.stream(), x).map_err(e("upload"))
}

fn zeros(nc: &NcclComm, floats: usize) -> Result<DeviceBuf<CudaDevice>, String> {
    DeviceBuf::zeroed(nc.device(), 4 * floats).map_err(e("alloc"))
}

fn down(nc: &NcclComm, b: &DeviceBuf<CudaDevice>) -> Result<Vec<f32>, String> {
    b.to_f32(nc.device(), nc.stream()).map_err(e("download"))
}

fn run(mpi: &Mpi) -> Result<usize, String> {
    let mut host = mpi.communicator(MpiOptions::default()).map_err(e("mpi communicator"))?;
    let required = std::env::var("ZEROPP_REQUIRE_GPU").is_ok_and(|v| v.trim() == "1");
    let world_size = host.topology().world();
    if world_size < 2 {
        // NCCL across processes needs two; one process has nothing to check here
        // (the one-GPU tests cover a single rank).
        println!("nccl_mpi: skipped: {world_size} process, NCCL across processes needs 2");
        return Ok(0);
    }
    // Each process takes the GPU of its node-local rank among those it sees
    // (one each under `CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK`).
    let local = host.topology().local_rank(host.rank());
    let device = CudaDevice::for_local_rank(local);
    // Agree before the communicator exists: NcclComm::new is collective, so a
    // rank that skipped alone would leave the others waiting in it for ever.
    let mine = [u64::from(device.is_ok())];
    let mut all = vec![0u64; world_size];
    host.all_gather(&Group::world(host.topology()), &mine, &mut all).map_err(e("agree on the devices"))?;
    let missing: Vec<usize> = all.iter().enumerate().filter(|(_, ok)| **ok == 0).map(|(r, _)| r).collect();
    let device = match device {
        Ok(d) if missing.is_empty() => d,
        result => {
            let why = match &result {
                Err(err) => format!("no CUDA device on this rank ({err})"),
                Ok(_) => format!("no CUDA device on rank(s) {missing:?}"),
            };
            if required {
                return Err(format!("ZEROPP_REQUIRE_GPU=1 but {why}"));
            }
            if host.rank() == 0 || result.is_err() {
                println!("nccl_mpi: skipped on rank {}: {why}", host.rank());
            }
            return Ok(0);
        }
    };
    let mut nc = NcclComm::new(&mut host, device).map_err(e("NcclComm::new"))?;
    let t = *nc.topology();
    let (rank, w) = (nc.rank(), t.world());
    let world = Group::world(&t);
    let mut checks = 0;
    let mut same = |what: &str, a: Vec<f32>, b: Vec<f32>| -> Result<(), String> {
        checks += 1;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if bits(&a) == bits(&b) {
            Ok(())
        } else {
            Err(format!("rank {rank}: {what} differs from the MPI reference"))
        }
    };

    // Primitives against MPI's.
    let x = rank_data(1, rank, 4 * w + 3);
    let gx = up(&nc, &x)?;
    let mut want = vec![0f32; x.len() * w];
    host.all_gather(&world, &x, &mut want).map_err(e("mpi all_gather"))?;
    let got = zeros(&nc, want.len())?;
    nc.all_gather(&world, gx.view(), got.view()).map_err(e("nccl all_gather"))?;
    same("all_gather", down(&nc, &got)?, want)?;
    let full = rank_data(2, rank, 4 * w);
    let gfull = up(&nc, &full)?;
    let mut want = vec![0f32; 4];
    host.reduce_scatter_f32(&world, &full, &mut want).map_err(e("mpi reduce_scatter"))?;
    let got = zeros(&nc, 4)?;
    nc.reduce_scatter_f32(&world, gfull.view(), got.view()).map_err(e("nccl reduce_scatter"))?;
    same("reduce_scatter", down(&nc, &got)?, want)?;
    let mut want = full.clone();
    host.all_reduce_f32(&world, &mut want).map_err(e("mpi all_reduce"))?;
    nc.all_reduce_f32(&world, gfull.view()).map_err(e("nccl all_reduce"))?;
    same("all_reduce", down(&nc, &gfull)?, want)?;
    let mut want = vec![0f32; x.len() * w];
    host.all_to_all(&world, &x.repeat(w)[..x.len() * w], &mut want).map_err(e("mpi all_to_all"))?;
    let gsend = up(&nc, &x.repeat(w))?;
    let got = zeros(&nc, want.len())?;
    nc.all_to_all(&world, gsend.view(), got.view()).map_err(e("nccl all_to_all"))?;
    same("all_to_all", down(&nc, &got)?, want)?;
    nc.barrier(&world).map_err(e("nccl barrier"))?;

    // ZeRO++ collectives against the host ones on MPI.
    let n = 3000 * w + 7;
    let grad = rank_data(5, rank, n);
    let mut want = vec![0f32; shard_len(n, w)];
    qgz_reduce_scatter(&mut host, &grad, &mut want, &QgzOptions::default()).map_err(e("host qgz"))?;
    let ggrad = up(&nc, &grad)?;
    let got = zeros(&nc, want.len())?;
    dev::qgz_reduce_scatter(&mut nc, ggrad.view(), got.view(), &QgzOptions::default())
        .map_err(e("device qgz"))?;
    same("qgz_reduce_scatter", down(&nc, &got)?, want)?;
    let shard = rank_data(7, rank, 1000);
    let mut want = vec![0f32; 1000 * w];
    qwz_all_gather(&mut host, &world, &shard, &mut want, &QwzOptions::default()).map_err(e("host qwz"))?;
    let gshard = up(&nc, &shard)?;
    let got = zeros(&nc, want.len())?;
    dev::qwz_all_gather(
        &mut nc,
        &world,
        gshard.view(),
        Elem::F32,
        got.view(),
        Elem::F32,
        &QwzOptions::default(),
    )
    .map_err(e("device qwz"))?;
    same("qwz_all_gather", down(&nc, &got)?, want)?;
    let node = Group::intra_node(&t, rank);
    let mut want = vec![0f32; 1000 * node.size()];
    qwz_all_gather(&mut host, &node, &shard, &mut want, &QwzOptions::default()).map_err(e("host hpz"))?;
    let got = zeros(&nc, want.len())?;
    dev::hpz_qwz_all_gather(&mut nc, gshard.view(), Elem::F32, got.view(), Elem::F32, &QwzOptions::default())
        .map_err(e("device hpz"))?;
    same("hpz_qwz_all_gather", down(&nc, &got)?, want)?;
    if nc.traffic().snapshot().total().inter.bytes_sent + nc.traffic().snapshot().total().intra.bytes_sent
        == 0
        && w > 1
    {
        return Err("no traffic counted".into());
    }
    Ok(checks)
}

fn main() {
    let mpi = match Mpi::init() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("nccl_mpi: MPI init failed: {e}");
            std::process::exit(2);
        }
    };
    match run(&mpi) {
        Ok(n) => {
            if mpi.rank() == 0 && n > 0 {
                println!("nccl_mpi: {n} checks passed on {} ranks", mpi.size());
            }
        }
        Err(msg) => mpi.abort(1, &format!("nccl_mpi: {msg}")),
    }
}
