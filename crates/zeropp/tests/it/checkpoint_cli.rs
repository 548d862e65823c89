//! `zeropp checkpoint inspect | export` on checkpoints written through the library.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use zeropp_partition::checkpoint::{shard_file_name, step_dir_name};
use zeropp_partition::{
    DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig, ShardState, Topology, save_checkpoint,
};

fn zeropp(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp")).arg("checkpoint").args(args).output().unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("checkpoint-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Saves a small 2-bucket model on 4 ranks (2 nodes × 2) at step 42.
fn write_checkpoint(dir: &Path) {
    let mut reg = ParamRegistry::new();
    let buckets = [
        ("embed", vec![ParamSpec::new("embed.w", [6, 4], DType::BF16)]),
        (
            "layer0",
            vec![ParamSpec::new("layer0.w", [4, 4], DType::F32), ParamSpec::new("layer0.b", [4], DType::F16)],
        ),
    ];
    for (name, params) in buckets {
        reg.push_bucket(name, params).unwrap();
    }
    let plan =
        PartitionPlan::new(&reg, Topology::ranks(4).per_node(2).unwrap(), PlanConfig::new(2, 2)).unwrap();
    let full: Vec<Vec<f32>> =
        plan.buckets().iter().map(|b| (0..b.numel).map(|i| i as f32 * 0.25).collect()).collect();
    let refs: Vec<&[f32]> = full.iter().map(Vec::as_slice).collect();
    let shards: Vec<ShardState> =
        (0..4).map(|r| ShardState::from_full_master(&plan, r, &refs).unwrap()).collect();
    save_checkpoint(dir, &plan, 42, &shards, Default::default()).unwrap();
}

#[test]
fn inspect_prints_topology_step_and_buckets() {
    let dir = scratch("inspect");
    write_checkpoint(&dir);
    let out = zeropp(&[Path::new("inspect"), &dir]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("step: 42"), "{stdout}");
    assert!(stdout.contains("world 4 = 2 nodes x 2 ranks/node"), "{stdout}");
    assert!(stdout.contains("all checksums verified"), "{stdout}");
    assert!(stdout.contains("rank-00003-of-00004.safetensors"), "{stdout}");
    assert!(stdout.contains("embed"), "{stdout}");
    assert!(stdout.contains("layer0"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn export_writes_consolidated_safetensors() {
    let dir = scratch("export");
    write_checkpoint(&dir);
    let file = dir.join("model.safetensors");
    let out = zeropp(&[Path::new("export"), &dir, &file]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("exported 3 tensors (44 parameters) from step 42"), "{stdout}");
    let bytes = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
    for name in ["\"embed.w\"", "\"layer0.w\"", "\"layer0.b\"", "[6,4]", "\"BF16\"", "\"F16\""] {
        assert!(header.contains(name), "{name} not in {header}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupted_checkpoint_fails_with_one_line_naming_the_file() {
    let dir = scratch("corrupt");
    write_checkpoint(&dir);
    let shard = dir.join(step_dir_name(42)).join(shard_file_name(1, 4));
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    for args in
        [vec![Path::new("inspect"), &dir], vec![Path::new("export"), &dir, &dir.join("out.safetensors")]]
    {
        let out = zeropp(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("checksum mismatch"), "{stderr}");
        assert!(stderr.contains("rank-00001-of-00004.safetensors"), "{stderr}");
    }
    assert!(!dir.join("out.safetensors").exists());
    // A folder with no checkpoint at all.
    let empty = scratch("empty");
    let out = zeropp(&[Path::new("inspect"), &empty]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no checkpoint found"));
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&empty).unwrap();
}

/// `zeropp checkpoint export DIR model.safetensors` with a bare file name writes into
/// the current directory (its empty parent once made the directory sync fail).
#[test]
fn export_to_a_bare_file_name_in_the_working_directory() {
    let dir = scratch("export-bare");
    write_checkpoint(&dir.join("ckpt"));
    let out = Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .current_dir(&dir)
        .args(["checkpoint", "export", "ckpt", "model.safetensors"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::metadata(dir.join("model.safetensors")).unwrap().len() > 8);
    assert!(!dir.join("model.safetensors.tmp").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
