//! Turning the layers' values into the typed sections: each option's type
//! is the type of the field that receives it. A TOML value is read as
//! TOML; text (environment, `--set`, ironic.conf) is parsed as the field
//! asks (a number, a boolean in oslo.config's spellings, a list, a string
//! as it is), so nothing is guessed before the field is known. The shapes
//! Ironic's options take (comma-separated lists, a boolean or a path) are
//! the helpers at the end.

use super::check::Problem;
use super::layers::{Layers, OptionName, Raw, Setting};
use crate::image_format::Format;
use serde::de::{self, DeserializeOwned, Deserializer, IntoDeserializer, MapAccess, Visitor};
use serde::{Deserialize, forward_to_deserialize_any};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// A value that does not fit its option.
#[derive(Debug)]
pub struct DeError(String);

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError(msg.to_string())
    }
}

/// Builds `T` (the whole configuration) from the effective values of
/// `layers`, with a problem for every option that does not fit: when they
/// do not all fit, each is tried alone, so one bad value never hides
/// another, and `T` is built of those that fit (the checks of the others
/// can still run). `Err` only when even those do not make a `T`.
pub fn typed<T: DeserializeOwned>(layers: &Layers) -> Result<(T, Vec<Problem>), Vec<Problem>> {
    let all: Vec<(&OptionName, &Setting)> = layers.effective().collect();
    if let Ok(value) = T::deserialize(Sections::of(&all)) {
        return Ok((value, Vec::new()));
    }
    let mut problems = Vec::new();
    let mut fitting = Vec::new();
    for (name, setting) in &all {
        match T::deserialize(Sections::of(&[(*name, *setting)])) {
            Ok(_) => fitting.push((*name, *setting)),
            Err(e) => problems.push(Problem {
                option: Some((*name).clone()),
                source: setting.source.clone(),
                message: plainer(&name.0, e.0),
            }),
        }
    }
    match T::deserialize(Sections::of(&fitting)) {
        Ok(value) => Ok((value, problems)),
        Err(e) => {
            // Options that fit alone but not together: name the first source.
            let source = fitting.first().map(|(_, s)| s.source.clone());
            problems.push(Problem::of_source(
                source.unwrap_or(super::origin::Source::Default),
                e.0,
            ));
            Err(problems)
        }
    }
}

/// serde's "unknown field" said in the configuration's words: an unknown
/// section or option, with the names it could have been.
fn plainer(section: &str, message: String) -> String {
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return message;
    };
    let (name, known) = rest.split_once('`').unwrap_or((rest, ""));
    let what = match name == section {
        true => "unknown section",
        false => "unknown option",
    };
    format!("{what}{}", known.replacen(", expected", "; expected", 1))
}

/// The whole configuration as a map of sections.
struct Sections(BTreeMap<String, BTreeMap<String, Raw>>);

impl Sections {
    fn of(settings: &[(&OptionName, &Setting)]) -> Sections {
        let mut sections: BTreeMap<String, BTreeMap<String, Raw>> = BTreeMap::new();
        for ((section, key), setting) in settings {
            sections
                .entry(section.clone())
                .or_default()
                .insert(key.clone(), setting.value.clone());
        }
        Sections(sections)
    }
}

impl<'de> Deserializer<'de> for Sections {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let sections = self
            .0
            .into_iter()
            .map(|(name, options)| (name, Options(options)));
        visitor.visit_map(de::value::MapDeserializer::new(sections))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

/// One section's options.
struct Options(BTreeMap<String, Raw>);

impl<'de> IntoDeserializer<'de, DeError> for Options {
    type Deserializer = Self;
    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> Deserializer<'de> for Options {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_map(OptionsAccess {
            options: self.0.into_iter(),
            next: None,
        })
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

/// The options of a section, one key and value at a time.
struct OptionsAccess {
    options: std::collections::btree_map::IntoIter<String, Raw>,
    next: Option<Raw>,
}

impl<'de> MapAccess<'de> for OptionsAccess {
    type Error = DeError;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        let Some((key, value)) = self.options.next() else {
            return Ok(None);
        };
        self.next = Some(value);
        seed.deserialize(key.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, DeError> {
        let value = self
            .next
            .take()
            .ok_or_else(|| de::Error::custom("a value without its option"))?;
        seed.deserialize(RawValue(value))
    }
}

/// One option's value.
struct RawValue(Raw);

impl RawValue {
    /// Text as a TOML array, when it is written as one (`["a", "b"]`).
    fn array(text: &str) -> Option<toml::Value> {
        if !text.trim_start().starts_with('[') {
            return None;
        }
        format!("v = {text}")
            .parse::<toml::Table>()
            .ok()?
            .remove("v")
            .filter(toml::Value::is_array)
    }

    /// Text as an integer: Rust's syntax, or TOML's (`1_000`, `0x10`).
    fn integer(text: &str) -> Result<i128, DeError> {
        let text = text.trim();
        text.parse::<i128>()
            .ok()
            .or_else(|| {
                format!("v = {text}")
                    .parse::<toml::Table>()
                    .ok()?
                    .get("v")?
                    .as_integer()
                    .map(i128::from)
            })
            .ok_or_else(|| DeError(format!("{text:?} is not an integer")))
    }
}

/// oslo.config's booleans (`true`/`false`, `yes`/`no`, `on`/`off`,
/// `1`/`0`, any case), as ironic.conf and oslo's variables spell them.
fn oslo_config_bool(text: &str) -> Result<bool, DeError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err(DeError(format!(
            "{text:?} is not a boolean (true or false)"
        ))),
    }
}

fn toml_error(e: toml::de::Error) -> DeError {
    DeError(e.message().trim().to_string())
}

macro_rules! text_as_integer {
    ($($method:ident => $visit:ident as $ty:ty),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
                match self.0 {
                    Raw::Toml(v) => v.$method(visitor).map_err(toml_error),
                    Raw::Text(t) => {
                        let n = Self::integer(&t)?;
                        let n = <$ty>::try_from(n).map_err(|_| {
                            DeError(format!("{} is out of range ({} to {})", n, <$ty>::MIN, <$ty>::MAX))
                        })?;
                        visitor.$visit(n)
                    }
                }
            }
        )*
    };
}

impl<'de> Deserializer<'de> for RawValue {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Raw::Toml(v) => v.deserialize_any(visitor).map_err(toml_error),
            Raw::Text(t) => match Self::array(&t) {
                Some(array) => array.deserialize_any(visitor).map_err(toml_error),
                None => visitor.visit_string(t),
            },
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Raw::Toml(v) => v.deserialize_bool(visitor).map_err(toml_error),
            Raw::Text(t) => visitor.visit_bool(oslo_config_bool(&t)?),
        }
    }

    text_as_integer! {
        deserialize_i8 => visit_i8 as i8,
        deserialize_i16 => visit_i16 as i16,
        deserialize_i32 => visit_i32 as i32,
        deserialize_i64 => visit_i64 as i64,
        deserialize_u8 => visit_u8 as u8,
        deserialize_u16 => visit_u16 as u16,
        deserialize_u32 => visit_u32 as u32,
        deserialize_u64 => visit_u64 as u64,
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Raw::Toml(v) => v.deserialize_f64(visitor).map_err(toml_error),
            Raw::Text(t) => visitor.visit_f64(
                t.trim()
                    .parse()
                    .map_err(|_| DeError(format!("{t:?} is not a number")))?,
            ),
        }
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_some(self)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Raw::Toml(v) => v.deserialize_string(visitor).map_err(toml_error),
            Raw::Text(t) => visitor.visit_string(t),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_string(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        match self.0 {
            Raw::Toml(v) => v
                .deserialize_enum(name, variants, visitor)
                .map_err(toml_error),
            Raw::Text(t) => visitor.visit_enum(t.trim().to_string().into_deserializer()),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    forward_to_deserialize_any! {
        i128 u128 char bytes byte_buf unit unit_struct seq tuple
        tuple_struct map struct identifier ignored_any
    }
}

// The shapes of Ironic's options, for `#[serde(deserialize_with)]`.

/// One string or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    /// One string (a comma-separated list, for some options).
    One(String),
    /// A TOML array.
    Many(Vec<String>),
}

/// Ironic list options are comma-separated strings; TOML arrays work too.
pub fn list_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let items = match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s.split(',').map(str::to_string).collect(),
        OneOrMany::Many(v) => v,
    };
    Ok(items
        .into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

/// A list option of paths.
pub fn path_list_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    Ok(list_opt(d)?.into_iter().map(PathBuf::from).collect())
}

/// A list option of image formats (`[conductor]permitted_image_formats`):
/// each name in any case, as Ironic's list was matched; one that names no
/// format the worker knows refuses the option.
pub fn format_list_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Format>, D::Error> {
    list_opt(d)?
        .iter()
        .map(|name| name.to_ascii_lowercase().parse().map_err(de::Error::custom))
        .collect()
}

/// An option that is a boolean or a string (`webserver_verify_ca`): a TOML
/// boolean is kept as its text.
pub fn bool_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Bool(bool),
        Text(String),
    }
    Ok(Some(match Either::deserialize(d)? {
        Either::Bool(b) => b.to_string(),
        Either::Text(s) => s,
    }))
}

#[cfg(test)]
mod tests {
    use super::super::layers::{Layers, Raw};
    use super::super::origin::Source;
    use super::typed;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Demo {
        s: Section,
    }

    #[derive(Debug, Deserialize, Default, PartialEq)]
    #[serde(rename_all = "lowercase")]
    enum Kind {
        #[default]
        Text,
        Json,
    }

    #[derive(Debug, Deserialize, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Section {
        kind: Kind,
        n: u16,
        b: bool,
        f: f64,
        text: String,
        maybe: Option<u64>,
        #[serde(deserialize_with = "super::list_opt")]
        list: Vec<String>,
    }

    fn with(options: &[(&str, Raw)]) -> Result<Demo, Vec<super::Problem>> {
        let mut layers = Layers::default();
        for (key, value) in options {
            layers.set("s", key, value.clone(), Source::Flag(format!("s.{key}")));
        }
        match typed(&layers)? {
            (demo, problems) if problems.is_empty() => Ok(demo),
            (_, problems) => Err(problems),
        }
    }

    fn text(t: &str) -> Raw {
        Raw::Text(t.to_string())
    }

    #[test]
    fn text_is_typed_by_the_option_receiving_it() {
        let d = with(&[
            ("n", text("1_000")),
            ("b", text("Yes")),
            ("f", text("1e3")),
            ("text", text("123456")),
            ("maybe", text("7")),
            ("list", text("a, b,,c")),
            ("kind", text("json")),
        ])
        .unwrap();
        assert_eq!(d.s.kind, Kind::Json);
        assert_eq!(d.s.n, 1000);
        assert!(d.s.b);
        assert_eq!(d.s.f, 1000.0);
        assert_eq!(d.s.text, "123456");
        assert_eq!(d.s.maybe, Some(7));
        assert_eq!(d.s.list, ["a", "b", "c"]);
        let d = with(&[("list", text(r#"["x", "y"]"#))]).unwrap();
        assert_eq!(d.s.list, ["x", "y"]);
        let d = with(&[("n", Raw::Toml(toml::Value::Integer(5)))]).unwrap();
        assert_eq!(d.s.n, 5);
    }

    #[test]
    fn every_option_that_does_not_fit_is_a_problem_of_its_own() {
        let problems = with(&[
            ("n", text("70000")),
            ("b", text("maybe")),
            ("text", text("fine")),
            ("nosuch", text("1")),
        ])
        .unwrap_err();
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].starts_with("[s]b (--set s.b): "), "{lines:?}");
        assert!(lines[0].contains("not a boolean"), "{lines:?}");
        assert!(lines[1].starts_with("[s]n (--set s.n): "), "{lines:?}");
        assert!(lines[1].contains("out of range"), "{lines:?}");
        assert!(
            lines[2].starts_with(
                "[s]nosuch (--set s.nosuch): unknown option; expected one of `kind`, `n`"
            ),
            "{lines:?}"
        );
    }
}
