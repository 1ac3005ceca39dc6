//! The unit converter tool: converts a value between two units of the same quantity (length, mass,
//! temperature, volume, speed, time, data, angle, pressure, energy). The units are an enum in the schema, so
//! a constrained model can only name units the tool knows; converting across quantities is a tool error.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thorn_plugin_sdk::Plugin;

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
    ($($variant:ident = $name:literal, $q:ident, $factor:expr, $offset:expr;)*) => {
        /// A unit the converter knows.
        #[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize, JsonSchema)]
        pub enum Unit {
            $(
                #[serde(rename = $name)]
                $variant,
            )*
        }

        impl Unit {
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
    Meter = "m", Length, 1.0, 0.0;
    Kilometer = "km", Length, 1000.0, 0.0;
    Centimeter = "cm", Length, 0.01, 0.0;
    Millimeter = "mm", Length, 0.001, 0.0;
    Micrometer = "um", Length, 1e-6, 0.0;
    Mile = "mi", Length, 1609.344, 0.0;
    Yard = "yd", Length, 0.9144, 0.0;
    Foot = "ft", Length, 0.3048, 0.0;
    Inch = "in", Length, 0.0254, 0.0;
    NauticalMile = "nmi", Length, 1852.0, 0.0;
    Kilogram = "kg", Mass, 1.0, 0.0;
    Gram = "g", Mass, 1e-3, 0.0;
    Milligram = "mg", Mass, 1e-6, 0.0;
    Tonne = "t", Mass, 1000.0, 0.0;
    Pound = "lb", Mass, 0.453_592_37, 0.0;
    Ounce = "oz", Mass, 0.028_349_523_125, 0.0;
    Stone = "st", Mass, 6.350_293_18, 0.0;
    Kelvin = "K", Temperature, 1.0, 0.0;
    Celsius = "C", Temperature, 1.0, 273.15;
    Fahrenheit = "F", Temperature, 5.0 / 9.0, 273.15 - 32.0 * 5.0 / 9.0;
    CubicMeter = "m3", Volume, 1.0, 0.0;
    Liter = "L", Volume, 1e-3, 0.0;
    Milliliter = "mL", Volume, 1e-6, 0.0;
    UsGallon = "gal", Volume, 3.785_411_784e-3, 0.0;
    UsQuart = "qt", Volume, 0.946_352_946e-3, 0.0;
    UsPint = "pt", Volume, 0.473_176_473e-3, 0.0;
    UsCup = "cup", Volume, 0.236_588_236_5e-3, 0.0;
    UsFluidOunce = "fl_oz", Volume, 29.573_529_562_5e-6, 0.0;
    MeterPerSecond = "m/s", Speed, 1.0, 0.0;
    KilometerPerHour = "km/h", Speed, 1.0 / 3.6, 0.0;
    MilePerHour = "mph", Speed, 0.447_04, 0.0;
    Knot = "kn", Speed, 1852.0 / 3600.0, 0.0;
    Millisecond = "ms", Time, 1e-3, 0.0;
    Second = "s", Time, 1.0, 0.0;
    Minute = "min", Time, 60.0, 0.0;
    Hour = "h", Time, 3600.0, 0.0;
    Day = "d", Time, 86_400.0, 0.0;
    Week = "wk", Time, 604_800.0, 0.0;
    Bit = "bit", Data, 0.125, 0.0;
    Byte = "B", Data, 1.0, 0.0;
    Kilobyte = "kB", Data, 1e3, 0.0;
    Megabyte = "MB", Data, 1e6, 0.0;
    Gigabyte = "GB", Data, 1e9, 0.0;
    Kibibyte = "KiB", Data, 1024.0, 0.0;
    Mebibyte = "MiB", Data, 1_048_576.0, 0.0;
    Gibibyte = "GiB", Data, 1_073_741_824.0, 0.0;
    Radian = "rad", Angle, 1.0, 0.0;
    Degree = "deg", Angle, std::f64::consts::PI / 180.0, 0.0;
    Turn = "turn", Angle, std::f64::consts::TAU, 0.0;
    Pascal = "Pa", Pressure, 1.0, 0.0;
    Kilopascal = "kPa", Pressure, 1e3, 0.0;
    Bar = "bar", Pressure, 1e5, 0.0;
    Psi = "psi", Pressure, 6_894.757_293_168, 0.0;
    Atmosphere = "atm", Pressure, 101_325.0, 0.0;
    Joule = "J", Energy, 1.0, 0.0;
    Kilojoule = "kJ", Energy, 1e3, 0.0;
    Calorie = "cal", Energy, 4.184, 0.0;
    Kilocalorie = "kcal", Energy, 4184.0, 0.0;
    WattHour = "Wh", Energy, 3600.0, 0.0;
    KilowattHour = "kWh", Energy, 3.6e6, 0.0;
}

/// Arguments of `convert`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Convert {
    /// The amount to convert.
    pub value: f64,
    /// The unit it is in.
    pub from: Unit,
    /// The unit wanted.
    pub to: Unit,
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
    .function(
        "convert",
        "Converts a value from one unit to another unit of the same quantity.",
        convert
    )
);

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
    fn schema_lists_the_units() {
        let s = thorn_plugin_sdk::schema_of::<Convert>();
        let units = s["properties"]["from"]["enum"].as_array().unwrap();
        assert!(units.iter().any(|u| u == "km/h"), "{s}");
        assert_eq!(s["additionalProperties"], false);
    }
}
