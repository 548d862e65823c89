//! Filesystem helpers: atomic, durable writes and reads that name the file
//! in their errors.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{LATEST_FILE, MANIFEST_FILE};
use crate::error::{PartitionError, Result};

/// fsyncs a folder so that a rename inside it is durable (no-op off Unix).
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| PartitionError::io(dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `bytes` to `path` atomically: `path.tmp`, fsync, rename, fsync the folder.
pub(super) fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    // A bare file name has an empty parent: that is the current directory.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or_else(|| Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let mut f = File::create(&tmp).map_err(|e| PartitionError::io(&tmp, e))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| PartitionError::io(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| PartitionError::io(path, e))?;
    sync_dir(dir)
}

/// Writes `path` atomically like [`atomic_write`], the content produced by
/// `write` through a buffered writer (so it need not be in memory at once).
/// On failure the temporary file is removed and `path` is untouched.
pub(super) fn atomic_write_with(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or_else(|| Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let f = File::create(&tmp).map_err(|e| PartitionError::io(&tmp, e))?;
    let mut w = BufWriter::with_capacity(super::CHUNK_BYTES, f);
    let written = write(&mut w).and_then(|()| {
        let f = w.into_inner().map_err(|e| PartitionError::io(&tmp, e.into_error()))?;
        f.sync_all().map_err(|e| PartitionError::io(&tmp, e))
    });
    if let Err(e) = written {
        fs::remove_file(&tmp).ok();
        return Err(e);
    }
    fs::rename(&tmp, path).map_err(|e| PartitionError::io(path, e))?;
    sync_dir(dir)
}

/// Reads a whole file; a missing file is [`PartitionError::MissingFile`].
pub(super) fn read_file(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| PartitionError::io(path, e))
}

/// The checkpoint folder `load_checkpoint(dir)` would read: `dir` itself
/// if it holds a manifest, else the folder named by `dir/LATEST`.
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(PartitionError::NoCheckpoint {
            dir: dir.to_path_buf(),
            reason: "not a directory (or does not exist)".into(),
        });
    }
    if dir.join(MANIFEST_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST_FILE);
    let text = match fs::read_to_string(&latest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(PartitionError::NoCheckpoint {
                dir: dir.to_path_buf(),
                reason: format!("neither {MANIFEST_FILE} nor {LATEST_FILE} exists"),
            });
        }
        Err(e) => return Err(PartitionError::io(&latest, e)),
    };
    let name = text.trim();
    let valid =
        name.strip_prefix("step-").is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()));
    if !valid {
        return Err(PartitionError::corrupt(
            &latest,
            format!("expected a folder name like step-00000123, found {name:?}"),
        ));
    }
    Ok(dir.join(name))
}
