//! The disk image formats the worker recognises, as a type: detected in
//! the bytes (`image/inspect.rs`), recorded in a master's sidecar, offered
//! to the other workers and permitted by `[conductor]permitted_image_formats`.
//! Each crosses a file, the wire or the configuration by the one name Glance's
//! `disk_format` and Ironic give it (lower case, as every earlier version
//! wrote it), and is parsed once where it comes in: a name this version does
//! not know is refused there, never carried along as a string.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A disk image format the worker can recognise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Anything without a known signature.
    Raw,
    /// A raw disk carrying a GUID partition table.
    Gpt,
    /// An ISO 9660 file system.
    Iso,
    /// QEMU copy-on-write v2/v3.
    Qcow2,
    /// QEMU enhanced disk (refused: it supports backing files only in ways we do not check).
    Qed,
    /// VMware disk.
    Vmdk,
    /// Virtual PC / Hyper-V legacy disk.
    Vhd,
    /// Hyper-V disk.
    Vhdx,
    /// VirtualBox disk.
    Vdi,
    /// LUKS-encrypted volume.
    Luks,
}

impl Format {
    /// Every format, for lookups by name.
    pub const ALL: [Format; 10] = [
        Format::Raw,
        Format::Gpt,
        Format::Iso,
        Format::Qcow2,
        Format::Qed,
        Format::Vmdk,
        Format::Vhd,
        Format::Vhdx,
        Format::Vdi,
        Format::Luks,
    ];

    /// The name used by Glance's `disk_format` and Ironic's permitted
    /// formats: the only spelling of a format in a file, on the wire and
    /// in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Gpt => "gpt",
            Format::Iso => "iso",
            Format::Qcow2 => "qcow2",
            Format::Qed => "qed",
            Format::Vmdk => "vmdk",
            Format::Vhd => "vhd",
            Format::Vhdx => "vhdx",
            Format::Vdi => "vdi",
            Format::Luks => "luks",
        }
    }

    /// True for formats whose bytes are the disk itself (served as `raw`).
    pub fn is_raw(self) -> bool {
        matches!(self, Format::Raw | Format::Gpt)
    }

    /// Whether this format must be converted when force_raw applies: raw and
    /// GPT disks are raw already, and Ironic never converts an ISO.
    pub fn needs_conversion(self) -> bool {
        !self.is_raw() && self != Format::Iso
    }

    /// The format bytes of this format are served as, unconverted: IPA only
    /// streams images announced as `raw`, which a GPT disk is.
    pub fn served(self) -> ServedFormat {
        ServedFormat(if self.is_raw() { Format::Raw } else { self })
    }
}

impl std::str::FromStr for Format {
    type Err = String;

    /// The format called `name`, exactly as [`Format::name`] spells it.
    fn from_str(name: &str) -> Result<Format, String> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
                format!("unknown image format {name:?} ({})", known.join(", "))
            })
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Format {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Format {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Format, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The `disk_format` announced for a master's bytes: a [`Format`] as it is
/// served, made only by [`Format::served`], so it is never `gpt` (a GPT
/// disk is announced as `raw`). Written and read by the format's name; a
/// record naming `gpt` here is refused like an unknown name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedFormat(Format);

impl ServedFormat {
    /// Its name, as announced to the agent (`image_disk_format`).
    pub fn name(self) -> &'static str {
        self.0.name()
    }
}

impl fmt::Display for ServedFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for ServedFormat {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for ServedFormat {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ServedFormat, D::Error> {
        let format = Format::deserialize(d)?;
        match format.served() {
            served if served.0 == format => Ok(served),
            _ => Err(serde::de::Error::custom(format!(
                "{format} is never a served format"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Format, ServedFormat};

    #[test]
    fn a_format_crosses_files_and_the_wire_by_its_lowercase_name() {
        for format in Format::ALL {
            let json = serde_json::to_string(&format).unwrap();
            assert_eq!(json, format!("\"{}\"", format.name()));
            assert_eq!(serde_json::from_str::<Format>(&json).unwrap(), format);
        }
        assert_eq!(Format::Qcow2.name(), "qcow2");
        assert_eq!(Format::Vhdx.to_string(), "vhdx");
        let error = serde_json::from_str::<Format>("\"floppy\"").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("unknown image format \"floppy\"")
        );
        // The names are exact: whatever is case-insensitive parses before.
        assert!("QCOW2".parse::<Format>().is_err());
    }

    #[test]
    fn a_gpt_disk_is_served_as_raw_and_nothing_is_served_as_gpt() {
        assert_eq!(Format::Gpt.served(), Format::Raw.served());
        assert_eq!(Format::Qcow2.served().name(), "qcow2");
        assert_eq!(Format::Gpt.served().name(), "raw");
        let raw: ServedFormat = serde_json::from_str("\"raw\"").unwrap();
        assert_eq!(raw, Format::Raw.served());
        assert!(serde_json::from_str::<ServedFormat>("\"gpt\"").is_err());
    }
}
