//! Image format detection from the bytes themselves (never from metadata),
//! in the spirit of oslo.utils' format inspector.

use crate::error::{Error, ErrorCode, Result};
use crate::image::qcow2;
use crate::image_format::Format;
use serde::Serialize;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes read from the start of a file for detection (ISO 9660 descriptors
/// start at 32 KiB).
pub const HEADER_LEN: usize = 64 * 1024;

/// Detects the format from the first [`HEADER_LEN`] bytes of an image.
pub fn detect(header: &[u8]) -> Format {
    let at = |off: usize, magic: &[u8]| header.get(off..off + magic.len()) == Some(magic);
    if at(0, b"QFI\xfb") {
        Format::Qcow2
    } else if at(0, b"QED\0") {
        Format::Qed
    } else if at(0, b"KDMV") || at(0, b"# Disk DescriptorFile") {
        Format::Vmdk
    } else if at(0, b"vhdxfile") {
        Format::Vhdx
    } else if at(0, b"conectix") {
        Format::Vhd
    } else if at(0x40, &0xbeda107f_u32.to_le_bytes()) {
        Format::Vdi
    } else if at(0, b"LUKS\xba\xbe") {
        Format::Luks
    } else if at(0x8001, b"CD001") {
        Format::Iso
    } else if at(510, &[0x55, 0xaa]) && (at(512, b"EFI PART") || at(4096, b"EFI PART")) {
        Format::Gpt
    } else {
        Format::Raw
    }
}

/// What inspection tells about an image file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inspection {
    /// The detected format.
    pub format: Format,
    /// Size of the disk the image describes (the file size for raw formats).
    pub virtual_size: u64,
    /// Size of the file itself.
    pub file_size: u64,
}

/// zstd frame magic: Ironic decompresses such downloads before inspecting.
pub fn is_zstd(header: &[u8]) -> bool {
    header.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
}

/// True when a download whose first chunk is `first` will not be served as
/// it is (a format converted under force_raw, or zstd, always decompressed):
/// its writer keeps it in the page cache for the reader that follows.
pub fn will_be_converted(first: &[u8]) -> bool {
    detect(first).needs_conversion() || is_zstd(first)
}

/// Reads the first [`HEADER_LEN`] bytes of `path` and its size.
pub fn read_header(path: &Path) -> Result<(Vec<u8>, u64)> {
    let file = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let file_size = file
        .metadata()
        .map_err(|e| Error::io("stat image", e))?
        .len();
    let mut header = vec![0u8; HEADER_LEN.min(file_size as usize)];
    file.read_exact_at(&mut header, 0)
        .map_err(|e| Error::io("read image header", e))?;
    Ok((header, file_size))
}

/// Detects the format of `path` and its virtual size.
pub fn inspect_file(path: &Path) -> Result<Inspection> {
    let (header, file_size) = read_header(path)?;
    let format = detect(&header);
    let truncated = || {
        Error::new(
            ErrorCode::CorruptImage,
            format!("{} header is truncated", format.name()),
        )
    };
    let be64 = |at: usize| {
        header
            .get(at..at + 8)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap_or_default()))
    };
    let le64 = |at: usize| {
        header
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    let virtual_size = match format {
        Format::Qcow2 => be64(24).ok_or_else(truncated)?,
        // A sparse VMDK's capacity, in sectors (a descriptor file alone
        // is refused by the safety check).
        Format::Vmdk if header.starts_with(b"KDMV") => {
            le64(12).ok_or_else(truncated)?.saturating_mul(512)
        }
        // The footer (its copy at the start of a dynamic disk): current size.
        Format::Vhd => be64(48).ok_or_else(truncated)?,
        // VDI 1.1: the disk size in the header.
        Format::Vdi => le64(0x170).ok_or_else(truncated)?,
        Format::Vhdx => vhdx_virtual_size(path)?,
        _ => file_size,
    };
    Ok(Inspection {
        format,
        virtual_size,
        file_size,
    })
}

/// The virtual size of a VHDX, read by `qemu-img info` (its metadata
/// region is a table of GUID-keyed items; VHDX has no backing-file
/// reference qemu follows).
fn vhdx_virtual_size(path: &Path) -> Result<u64> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-f", "vhdx"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Error::io("run qemu-img info", e))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    info["virtual-size"].as_u64().ok_or_else(|| {
        Error::new(
            ErrorCode::CorruptImage,
            format!(
                "vhdx: no virtual size: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        )
    })
}

/// Checks the L1 table (and the snapshot table, if any) of the qcow2 at
/// `path` whose `header` was parsed, against a file of `file_size` bytes
/// (the announced size while it is still downloading).
pub fn check_qcow2_tables(path: &Path, header: &qcow2::Header, file_size: u64) -> Result<()> {
    let read = |len: u64, at: u64, what: &str| {
        let mut buf = vec![0u8; len as usize];
        File::open(path)
            .and_then(|f| f.read_exact_at(&mut buf, at))
            .map_err(|e| Error::io(format!("read qcow2 {what}"), e))?;
        Ok::<_, Error>(buf)
    };
    let l1 = read(
        header.l1_size as u64 * 8,
        header.l1_table_offset,
        "L1 table",
    )?;
    qcow2::check_l1_table(header, &l1, file_size)?;
    if header.nb_snapshots > 0 {
        let len = (file_size - header.snapshots_offset).min(64 << 20);
        let table = read(len, header.snapshots_offset, "snapshot table")?;
        qcow2::check_snapshot_table(header, &table, file_size)?;
    }
    Ok(())
}

/// [`check_qcow2_tables`] on a blocking thread: the tables may be tens of
/// MiB, read while the runtime serves images.
pub async fn check_qcow2_tables_blocking(
    path: &Path,
    header: &qcow2::Header,
    file_size: u64,
) -> Result<()> {
    let (path, header) = (path.to_path_buf(), header.clone());
    tokio::task::spawn_blocking(move || check_qcow2_tables(&path, &header, file_size))
        .await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("table check task: {e}")))?
}

/// [`safety_check`] on a blocking thread (it reads the image's tables).
pub async fn spawn_safety_check(
    path: &Path,
    found: &Inspection,
    limits: qcow2::Limits,
) -> Result<Option<qcow2::Header>> {
    let (path, found) = (path.to_path_buf(), found.clone());
    tokio::task::spawn_blocking(move || safety_check(&path, &found, limits))
        .await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("safety check task: {e}")))?
}

/// The deep safety check of an image of format `found.format`: qcow2
/// headers and L1 tables are validated, QED is refused, VMDK must be a
/// self-contained monolithicSparse or streamOptimized disk. Returns the
/// parsed qcow2 header for the converter.
pub fn safety_check(
    path: &Path,
    found: &Inspection,
    limits: qcow2::Limits,
) -> Result<Option<qcow2::Header>> {
    if found.virtual_size > limits.max_virtual_size {
        return Err(Error::new(
            ErrorCode::UnsafeImage,
            format!(
                "{}: virtual size {} exceeds the limit {} ([convert]max_virtual_size_gib)",
                found.format.name(),
                found.virtual_size,
                limits.max_virtual_size
            ),
        ));
    }
    match found.format {
        Format::Qcow2 => {
            let (head, file_size) = read_header(path)?;
            let header = qcow2::parse(&head, file_size, limits)?;
            check_qcow2_tables(path, &header, file_size)?;
            Ok(Some(header))
        }
        Format::Qed => Err(Error::new(
            ErrorCode::UnsafeImage,
            "QED images are refused (backing files cannot be ruled out)",
        )),
        Format::Vmdk => {
            check_vmdk(path)?;
            Ok(None)
        }
        _ => Ok(None),
    }
}

fn check_vmdk(path: &Path) -> Result<()> {
    let (head, file_size) = read_header(path)?;
    let descriptor: Vec<u8> = if head.starts_with(b"KDMV") {
        let le64 = |off: usize| {
            head.get(off..off + 8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
                .unwrap_or(0)
        };
        let (offset, size) = (le64(28).saturating_mul(512), le64(36).saturating_mul(512));
        if size == 0 || size > 1 << 20 || offset.saturating_add(size) > file_size {
            return Err(Error::new(
                ErrorCode::CorruptImage,
                "vmdk: bad embedded descriptor",
            ));
        }
        let mut d = vec![0u8; size as usize];
        File::open(path)
            .and_then(|f| f.read_exact_at(&mut d, offset))
            .map_err(|e| Error::io("read vmdk descriptor", e))?;
        d
    } else {
        head
    };
    let text = String::from_utf8_lossy(&descriptor);
    let create_type = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("createType"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .next()
        .unwrap_or_default();
    match create_type.as_str() {
        "monolithicSparse" | "streamOptimized" => Ok(()),
        other => Err(Error::new(
            ErrorCode::UnsafeImage,
            format!(
                "vmdk createType {other:?} may reference other files; only monolithicSparse and streamOptimized are accepted"
            ),
        )),
    }
}

/// Checks the detected format against the declared `image_disk_format` (a
/// declared `raw` also accepts a GPT disk) and the permitted list.
pub fn check_format(detected: Format, declared: Option<&str>, permitted: &[Format]) -> Result<()> {
    if let Some(declared) = declared.map(str::trim).filter(|d| !d.is_empty()) {
        let declared = declared.to_ascii_lowercase();
        // Kernels and ramdisks declared ari/aki are raw bytes, as Ironic allows.
        let matches = declared == detected.name()
            || (declared == "raw" && detected.is_raw())
            || declared == "ari"
            || declared == "aki";
        if !matches {
            return Err(Error::new(
                ErrorCode::FormatMismatch,
                format!("image declared as {declared} but its content is {detected}"),
            ));
        }
    }
    if !permitted.contains(&detected) {
        let permitted: Vec<&str> = permitted.iter().map(|f| f.name()).collect();
        return Err(Error::new(
            ErrorCode::FormatNotPermitted,
            format!(
                "image format {detected} is not in [conductor]permitted_image_formats ({})",
                permitted.join(", ")
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(off: usize, magic: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_LEN];
        h[off..off + magic.len()].copy_from_slice(magic);
        h
    }

    #[test]
    fn detects_signatures() {
        assert_eq!(detect(&with(0, b"QFI\xfb")), Format::Qcow2);
        assert_eq!(detect(&with(0, b"QED\0")), Format::Qed);
        assert_eq!(detect(&with(0, b"KDMV")), Format::Vmdk);
        assert_eq!(detect(&with(0, b"vhdxfile")), Format::Vhdx);
        assert_eq!(detect(&with(0, b"conectix")), Format::Vhd);
        assert_eq!(detect(&with(0x40, &[0x7f, 0x10, 0xda, 0xbe])), Format::Vdi);
        assert_eq!(detect(&with(0, b"LUKS\xba\xbe")), Format::Luks);
        assert_eq!(detect(&with(0x8001, b"CD001")), Format::Iso);
        let mut gpt = with(512, b"EFI PART");
        gpt[510] = 0x55;
        gpt[511] = 0xaa;
        assert_eq!(detect(&gpt), Format::Gpt);
        assert_eq!(detect(&[1, 2, 3]), Format::Raw);
    }

    #[test]
    fn declared_and_permitted() {
        let permitted = [Format::Raw, Format::Gpt, Format::Qcow2];
        assert!(check_format(Format::Gpt, Some("raw"), &permitted).is_ok());
        assert_eq!(
            check_format(Format::Qcow2, Some("raw"), &permitted)
                .unwrap_err()
                .code,
            ErrorCode::FormatMismatch
        );
        assert_eq!(
            check_format(Format::Vmdk, None, &permitted)
                .unwrap_err()
                .code,
            ErrorCode::FormatNotPermitted
        );
    }
}
