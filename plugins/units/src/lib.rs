//! The unit converter tool: converts a value between two units of the same quantity (length, mass,
//! temperature, volume, speed, time, data, angle, pressure, energy). A unit is named as people write it:
//! its symbol (`ft`) or a name or plural in any case (`feet`, `Miles per hour`, `degrees Fahrenheit`), so a
//! small model can copy it from the request (the function declares `from` and `to` as `from_request`). An
//! unknown unit, or converting across quantities, is a tool error that says what is known.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thorn_plugin_sdk::{Plugin, json};

/// What a unit measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Quantity {
    /// Distance.
    Length,
    /// Mass.
    Mass,
    /// Temperature (affine: offsets as well as factors).
    Temperature,
    /// Volume.
    Volume,
    /// Speed.
    Speed,
    /// Duration.
    Time,
    /// Amount of digital information.
    Data,
    /// Plane angle.
    Angle,
    /// Pressure.
    Pressure,
    /// Energy.
    Energy,
}

macro_rules! units {
    ($($variant:ident = $name:literal [$($alias:literal),*], $q:ident, $factor:expr, $offset:expr;)*) => {
        /// A unit the converter knows.
        #[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize, JsonSchema)]
        pub enum Unit {
            $(
                #[serde(rename = $name)]
                $variant,
            )*
        }

        impl Unit {
            /// Every unit: its symbol and its name (`MilePerHour`).
            pub const GLOSSARY: &[(&str, &str)] = &[$(($name, stringify!($variant)),)*];

            /// The unit a person's word names: its symbol (`ft`), or a name or plural in any case
            /// (`feet`, `Miles per hour`), optionally after "degrees" (`degrees Fahrenheit`).
            pub fn named(word: &str) -> Option<Unit> {
                $(if word == $name { return Some(Unit::$variant); })*
                let lower = word.trim().to_lowercase();
                let lower = lower.strip_prefix("degrees ").or_else(|| lower.strip_prefix("degree ")).unwrap_or(&lower);
                $(if lower == $name.to_lowercase() $(|| lower == $alias)* { return Some(Unit::$variant); })*
                None
            }

            /// The quantity, and how to reach the SI base: `si = value * factor + offset`.
            pub fn def(self) -> (Quantity, f64, f64) {
                match self {
                    $(Unit::$variant => (Quantity::$q, $factor, $offset),)*
                }
            }
        }
    };
}

units! {
    Meter = "m" ["meter", "meters", "metre", "metres"], Length, 1.0, 0.0;
    Kilometer = "km" ["kilometer", "kilometers", "kilometre", "kilometres"], Length, 1000.0, 0.0;
    Centimeter = "cm" ["centimeter", "centimeters", "centimetre", "centimetres"], Length, 0.01, 0.0;
    Millimeter = "mm" ["millimeter", "millimeters", "millimetre", "millimetres"], Length, 0.001, 0.0;
    Micrometer = "um" ["micrometer", "micrometers", "micron", "microns"], Length, 1e-6, 0.0;
    Mile = "mi" ["mile", "miles"], Length, 1609.344, 0.0;
    Yard = "yd" ["yard", "yards"], Length, 0.9144, 0.0;
    Foot = "ft" ["foot", "feet"], Length, 0.3048, 0.0;
    Inch = "in" ["inch", "inches"], Length, 0.0254, 0.0;
    NauticalMile = "nmi" ["nautical mile", "nautical miles"], Length, 1852.0, 0.0;
    Kilogram = "kg" ["kilogram", "kilograms", "kilo", "kilos"], Mass, 1.0, 0.0;
    Gram = "g" ["gram", "grams"], Mass, 1e-3, 0.0;
    Milligram = "mg" ["milligram", "milligrams"], Mass, 1e-6, 0.0;
    Tonne = "t" ["tonne", "tonnes", "metric ton", "metric tons"], Mass, 1000.0, 0.0;
    Pound = "lb" ["pound", "pounds", "lbs"], Mass, 0.453_592_37, 0.0;
    Ounce = "oz" ["ounce", "ounces"], Mass, 0.028_349_523_125, 0.0;
    Stone = "st" ["stone", "stones"], Mass, 6.350_293_18, 0.0;
    Kelvin = "K" ["kelvin"], Temperature, 1.0, 0.0;
    Celsius = "C" ["celsius", "centigrade", "°c"], Temperature, 1.0, 273.15;
    Fahrenheit = "F" ["fahrenheit", "°f"], Temperature, 5.0 / 9.0, 273.15 - 32.0 * 5.0 / 9.0;
    CubicMeter = "m3" ["cubic meter", "cubic meters", "cubic metre", "cubic metres"], Volume, 1.0, 0.0;
    Liter = "L" ["liter", "liters", "litre", "litres"], Volume, 1e-3, 0.0;
    Milliliter = "mL" ["milliliter", "milliliters", "millilitre", "millilitres", "ml"], Volume, 1e-6, 0.0;
    UsGallon = "gal" ["gallon", "gallons", "us gallon", "us gallons"], Volume, 3.785_411_784e-3, 0.0;
    UsQuart = "qt" ["quart", "quarts"], Volume, 0.946_352_946e-3, 0.0;
    UsPint = "pt" ["pint", "pints"], Volume, 0.473_176_473e-3, 0.0;
    UsCup = "cup" ["cups"], Volume, 0.236_588_236_5e-3, 0.0;
    UsFluidOunce = "fl_oz" ["fluid ounce", "fluid ounces"], Volume, 29.573_529_562_5e-6, 0.0;
    MeterPerSecond = "m/s" ["meters per second", "metres per second"], Speed, 1.0, 0.0;
    KilometerPerHour = "km/h" ["kilometers per hour", "kilometres per hour", "kph", "kmh"], Speed, 1.0 / 3.6, 0.0;
    MilePerHour = "mph" ["miles per hour"], Speed, 0.447_04, 0.0;
    Knot = "kn" ["knot", "knots"], Speed, 1852.0 / 3600.0, 0.0;
    Millisecond = "ms" ["millisecond", "milliseconds"], Time, 1e-3, 0.0;
    Second = "s" ["second", "seconds", "sec", "secs"], Time, 1.0, 0.0;
    Minute = "min" ["minute", "minutes", "mins"], Time, 60.0, 0.0;
    Hour = "h" ["hour", "hours", "hr", "hrs"], Time, 3600.0, 0.0;
    Day = "d" ["day", "days"], Time, 86_400.0, 0.0;
    Week = "wk" ["week", "weeks"], Time, 604_800.0, 0.0;
    Bit = "bit" ["bits"], Data, 0.125, 0.0;
    Byte = "B" ["byte", "bytes"], Data, 1.0, 0.0;
    Kilobyte = "kB" ["kilobyte", "kilobytes", "kb"], Data, 1e3, 0.0;
    Megabyte = "MB" ["megabyte", "megabytes", "mb"], Data, 1e6, 0.0;
    Gigabyte = "GB" ["gigabyte", "gigabytes", "gb"], Data, 1e9, 0.0;
    Kibibyte = "KiB" ["kibibyte", "kibibytes", "kib"], Data, 1024.0, 0.0;
    Mebibyte = "MiB" ["mebibyte", "mebibytes", "mib"], Data, 1_048_576.0, 0.0;
    Gibibyte = "GiB" ["gibibyte", "gibibytes", "gib"], Data, 1_073_741_824.0, 0.0;
    Radian = "rad" ["radian", "radians"], Angle, 1.0, 0.0;
    Degree = "deg" ["degree", "degrees"], Angle, std::f64::consts::PI / 180.0, 0.0;
    Turn = "turn" ["turns", "revolution", "revolutions"], Angle, std::f64::consts::TAU, 0.0;
    Pascal = "Pa" ["pascal", "pascals"], Pressure, 1.0, 0.0;
    Kilopascal = "kPa" ["kilopascal", "kilopascals"], Pressure, 1e3, 0.0;
    Bar = "bar" ["bars"], Pressure, 1e5, 0.0;
    Psi = "psi" [], Pressure, 6_894.757_293_168, 0.0;
    Atmosphere = "atm" ["atmosphere", "atmospheres"], Pressure, 101_325.0, 0.0;
    Joule = "J" ["joule", "joules"], Energy, 1.0, 0.0;
    Kilojoule = "kJ" ["kilojoule", "kilojoules"], Energy, 1e3, 0.0;
    Calorie = "cal" ["calorie", "calories"], Energy, 4.184, 0.0;
    Kilocalorie = "kcal" ["kilocalorie", "kilocalories"], Energy, 4184.0, 0.0;
    WattHour = "Wh" ["watt hour", "watt hours"], Energy, 3600.0, 0.0;
    KilowattHour = "kWh" ["kilowatt hour", "kilowatt hours"], Energy, 3.6e6, 0.0;
}

/// Arguments of `convert`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Convert {
    /// The amount to convert.
    pub value: f64,
    /// The unit it is in: a symbol (`ft`) or a name (`feet`).
    #[serde(deserialize_with = "unit_named")]
    #[schemars(with = "String", length(min = 1, max = 64))]
    pub from: Unit,
    /// The unit wanted: a symbol (`m`) or a name (`meters`).
    #[serde(deserialize_with = "unit_named")]
    #[schemars(with = "String", length(min = 1, max = 64))]
    pub to: Unit,
}

/// A unit from its symbol or name ([`Unit::named`]); an unknown one is an error that lists the symbols.
fn unit_named<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Unit, D::Error> {
    let word = String::deserialize(d)?;
    Unit::named(&word).ok_or_else(|| {
        let symbols: Vec<&str> = Unit::GLOSSARY.iter().map(|(s, _)| *s).collect();
        serde::de::Error::custom(format!(
            "unknown unit {word:?}; the units are {}",
            symbols.join(", ")
        ))
    })
}

/// A converted amount.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Converted {
    /// The amount in the target unit.
    pub value: f64,
    /// The target unit.
    pub unit: Unit,
    /// What was converted.
    pub quantity: Quantity,
}

/// Converts `c.value` from `c.from` to `c.to`.
pub fn convert(c: Convert) -> Result<Converted, String> {
    let (qf, ff, of) = c.from.def();
    let (qt, ft, ot) = c.to.def();
    if qf != qt {
        return Err(format!(
            "cannot convert {qf:?} ({:?}) to {qt:?} ({:?})",
            c.from, c.to
        ));
    }
    if !c.value.is_finite() {
        return Err("the value must be a finite number".into());
    }
    if qf == Quantity::Temperature && c.value * ff + of < 0.0 {
        return Err(format!("{} {:?} is below absolute zero", c.value, c.from));
    }
    let si = c.value * ff + of;
    let value = (si - ot) / ft;
    // Round away the last-bit noise of the two multiplications (12 significant digits are plenty).
    let value = if value == 0.0 {
        0.0
    } else {
        let digits = 12 - value.abs().log10().ceil() as i32;
        let scale = 10f64.powi(digits.clamp(-300, 300));
        (value * scale).round() / scale
    };
    Ok(Converted {
        value,
        unit: c.to,
        quantity: qf,
    })
}

thorn_plugin_sdk::plugin!(
    Plugin::new(
        "units",
        "0.1.0",
        "Converts amounts between units of length, mass, temperature, volume, speed, time, data, angle, pressure and energy."
    )
    .function("convert", &convert_description(), convert)
    .read_only()
    .from_request(&["from", "to"])
    .example(
        "How many kilometers is 5 miles?",
        json!({"value": 5, "from": "miles", "to": "kilometers"})
    )
    .example(
        "Convert 70 degrees Fahrenheit to Celsius.",
        json!({"value": 70, "from": "Fahrenheit", "to": "Celsius"})
    )
    .example(
        "What is 3 kg in pounds?",
        json!({"value": 3, "from": "kg", "to": "pounds"})
    )
    .example(
        "How many minutes are in 2 days?",
        json!({"value": 2, "from": "days", "to": "minutes"})
    )
    .example(
        "Convert 2 liters to US gallons.",
        json!({"value": 2, "from": "liters", "to": "US gallons"})
    )
    .example(
        "How many MB are in 3 GB?",
        json!({"value": 3, "from": "GB", "to": "MB"})
    )
    .answer(
        "{{ arguments.value | num }} {{ arguments.from }} = {{ result.value | num }} {{ result.unit }}"
    )
);

/// What `convert` does, with every unit's symbol and name (`mph = mile per hour`): the schema lists only
/// the symbols, and a model (and the tool router) must find "pounds" in `lb`.
fn convert_description() -> String {
    let names: Vec<String> = Unit::GLOSSARY
        .iter()
        .map(|(symbol, variant)| {
            let mut words = String::new();
            for c in variant.chars() {
                if c.is_uppercase() && !words.is_empty() {
                    words.push(' ');
                }
                words.push(c.to_ascii_lowercase());
            }
            format!("{symbol} = {}", words.replace("us ", "US "))
        })
        .collect();
    format!(
        "Converts a value from one unit to another of the same quantity. Units: {}.",
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(value: f64, from: Unit, to: Unit) -> f64 {
        convert(Convert { value, from, to }).unwrap().value
    }

    #[test]
    fn converts_within_a_quantity() {
        assert_eq!(conv(1.0, Unit::Mile, Unit::Kilometer), 1.609344);
        assert_eq!(conv(100.0, Unit::Celsius, Unit::Fahrenheit), 212.0);
        assert_eq!(conv(-40.0, Unit::Fahrenheit, Unit::Celsius), -40.0);
        assert_eq!(conv(0.0, Unit::Celsius, Unit::Kelvin), 273.15);
        assert_eq!(conv(1.0, Unit::Gibibyte, Unit::Megabyte), 1073.741824);
        assert_eq!(conv(180.0, Unit::Degree, Unit::Radian), 3.14159265359);
        assert_eq!(conv(1.0, Unit::Atmosphere, Unit::Psi), 14.6959487755);
        assert_eq!(
            conv(36.0, Unit::KilometerPerHour, Unit::MeterPerSecond),
            10.0
        );
        assert_eq!(
            conv(1.0, Unit::KilowattHour, Unit::Kilocalorie),
            860.420650096
        );
    }

    #[test]
    fn refuses_nonsense() {
        let e = convert(Convert {
            value: 1.0,
            from: Unit::Meter,
            to: Unit::Kilogram,
        })
        .unwrap_err();
        assert!(e.contains("cannot convert Length"), "{e}");
        let e = convert(Convert {
            value: -300.0,
            from: Unit::Celsius,
            to: Unit::Kelvin,
        })
        .unwrap_err();
        assert!(e.contains("absolute zero"), "{e}");
    }

    #[test]
    fn units_are_named_as_people_write_them() {
        for (word, unit) in [
            ("ft", Unit::Foot),
            ("feet", Unit::Foot),
            ("Feet", Unit::Foot),
            ("degrees Fahrenheit", Unit::Fahrenheit),
            ("Celsius", Unit::Celsius),
            ("C", Unit::Celsius),
            ("km/h", Unit::KilometerPerHour),
            ("miles per hour", Unit::MilePerHour),
            ("degrees", Unit::Degree),
            ("GiB", Unit::Gibibyte),
            ("MB", Unit::Megabyte),
            ("mL", Unit::Milliliter),
            ("US gallons", Unit::UsGallon),
        ] {
            assert_eq!(Unit::named(word), Some(unit), "{word}");
        }
        assert_eq!(Unit::named("parsecs"), None);
        let c: Convert =
            serde_json::from_str(r#"{"value": 6, "from": "feet", "to": "meters"}"#).unwrap();
        assert!((convert(c).unwrap().value - 1.8288).abs() < 1e-9);
        let e = serde_json::from_str::<Convert>(r#"{"value": 1, "from": "parsec", "to": "m"}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("unknown unit") && e.contains("km/h"), "{e}");
        // Every symbol names its own unit.
        for (symbol, _) in Unit::GLOSSARY {
            assert_eq!(
                Unit::named(symbol).map(|u| serde_json::to_value(u).unwrap()),
                Some(serde_json::json!(symbol))
            );
        }
        let s = thorn_plugin_sdk::schema_of::<Convert>();
        assert_eq!(s["properties"]["from"]["type"], "string", "{s}");
        assert_eq!(s["additionalProperties"], false);
    }
}
