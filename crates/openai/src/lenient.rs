//! How fields are read where servers differ from OpenAI and from each other.

use serde::Deserialize;
use serde::de::{Deserializer, Error, Unexpected};
use serde_json::Value;
use std::borrow::Cow;

/// `null` read as the type's default (servers write `null` where OpenAI leaves a field out).
pub(crate) fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Unexpected::Signed(i),
            None => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

/// A tool call's `arguments`: JSON text, as OpenAI sends them, or the object itself, as some servers do
/// (read as its JSON text); `null` reads as absent.
pub(crate) fn arguments_opt<'de, 'a, D>(d: D) -> Result<Option<Cow<'a, str>>, D::Error>
where
    D: Deserializer<'de>,
{
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(Cow::Owned(s))),
        Some(v @ (Value::Object(_) | Value::Array(_))) => Ok(Some(Cow::Owned(v.to_string()))),
        Some(other) => Err(D::Error::invalid_type(
            unexpected(&other),
            &"the arguments as JSON text (or the object itself)",
        )),
    }
}

/// [`arguments_opt`], absent read as `""`.
pub(crate) fn arguments<'de, 'a, D>(d: D) -> Result<Cow<'a, str>, D::Error>
where
    D: Deserializer<'de>,
{
    Ok(arguments_opt(d)?.unwrap_or_default())
}
