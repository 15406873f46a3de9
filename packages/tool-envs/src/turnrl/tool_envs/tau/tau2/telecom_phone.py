"""tau2-bench telecom, the user's side: a simulated phone and the 30 tools the user works it with.

The phone is a plain dict in the form of upstream's ``TelecomUserDB.model_dump()``: a
``device`` record (radios, SIM, APN, VPN, apps and their permissions) and a ``surroundings``
record (who the user is, whether they are abroad, the signal per network technology and the
backend facts that ``sync_tools`` copies from the CRM). Enums are their string values.

Most of what the user sees is computed, by upstream's rules:

* a network search connects to the technology the mode preference allows (5G when the
  surroundings have a 5G signal, else 4G, or the one technology a "... only" mode names) at
  that technology's signal, unless the SIM is missing or locked, airplane mode is on, the APN
  is broken or the line is inactive (then no service, no technology, no signal);
* mobile data works unless airplane mode is on, there is no signal or no service, the user is
  abroad without roaming enabled on the phone *and* allowed on the line, data is off, or the
  plan's data is used up;
* the speed is the middle of the technology's range (2G 0.1-0.4, 3G 1-5, 4G 10-100,
  5G 50-500 Mbps) times the signal factor (poor 0.2, fair 0.5, good 0.8, excellent 1.0),
  times 0.1 behind a poorly performing VPN and 0.2 with data saver on, rounded to 2 decimals;
* MMS works when mobile data works, the phone is not on 2G, Wi-Fi calling does not carry MMS
  over Wi-Fi, the APN has an MMSC URL and the messaging app holds the sms and storage
  permissions.

Upstream quirks kept on purpose: arguments are not type-checked (``set_network_mode_preference``
stores a non-string mode, then fails; ``set_apn_settings`` stores a non-object, after which
every APN access fails as upstream's attribute access does), a dict of APN settings is
validated with pydantic's rules and error text, and ``break_vpn`` makes the VPN it connects
perform poorly *and* every later ``connect_vpn`` of the episode (upstream shares one default
VPN record; here the sharing stays inside one episode).

What the domain glue (``sync_tools``) uses, besides the tools:

* ``phone.phone_number``: the user's number (``None`` until ``set_user_info``: then no sync);
* ``phone.sync_line(line_active=..., roaming_allowed=..., data_usage_exceeded=...)``: copy
  the line's facts into the surroundings (no network search: the device sees them at its next
  one);
* ``phone.payment_request``: the pending request (``{"bill_id", "amount_due", "paid"}``) or
  ``None``; ``phone.paid_bill_id()``: its bill id once ``make_payment`` has paid it;
  ``phone.clear_payment_request()`` after the CRM marked that bill paid;
  ``phone.request_payment(bill_id, amount_due)`` to send a new one.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import math
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.tau2.toolkit import ToolKind, Toolkit, deep_merge, tool

SIM_STATUSES = ("active", "missing", "locked_pin", "locked_puk")
TECHNOLOGIES = ("none", "2G", "3G", "4G", "5G")
MODES = ("4g_5g_preferred", "4g_only", "3g_only", "2g_only")
SIGNALS = ("none", "poor", "fair", "good", "excellent")
PERFORMANCES = ("unknown", "poor", "fair", "good", "excellent")
NETWORK_STATUSES = ("connected", "searching", "no_service", "emergency_only")
APN_NAMES = ("internet", "broken")
PERMISSIONS = ("sms", "storage", "phone", "network")

SPEED_RANGES = {"2G": (0.1, 0.4), "3G": (1.0, 5.0), "4G": (10.0, 100.0), "5G": (50.0, 500.0)}
SIGNAL_FACTORS = {"poor": 0.2, "fair": 0.5, "good": 0.8, "excellent": 1.0}
SPEED_ADVICE = {
    "Very Poor": "Connection is very slow. Basic web browsing might be difficult.",
    "Poor": "Connection is slow. Web browsing may be sluggish, streaming difficult.",
    "Fair": "Connection is okay for web browsing and some standard definition streaming.",
    "Good": "Connection is good for most activities, including HD streaming.",
    "Excellent": "Connection is very fast.",
}
SIGNAL_ICONS = {
    "none": "📵 No Signal",
    "poor": "📶¹ Poor",
    "fair": "📶² Fair",
    "good": "📶³ Good",
    "excellent": "📶⁴ Excellent",
}
SIM_TEXTS = {
    "active": "Your SIM card is active and working.",
    "missing": "No SIM card detected in the phone.",
    "locked_pin": "The SIM card is locked with a PIN code.",
    "locked_puk": "The SIM card is locked with a PUK code.",
}
MODE_TECHNOLOGY = {"4g_only": "4G", "3g_only": "3G", "2g_only": "2G"}
DEFAULT_VPN = {
    "server_address": "192.168.1.1",
    "protocol": "OpenVPN",
    "server_performance": "excellent",
}


# --- validation with pydantic's rules and messages (upstream validates with pydantic) ---


class _Invalid(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@functools.cache
def _pydantic_docs_version() -> str:
    """The major.minor of pydantic in pydantic's error links (installed pydantic, else 2.14)."""
    try:
        return ".".join(importlib.metadata.version("pydantic").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return "2.14"


class ValidationError(ValueError):
    """Bad data for a record, worded as pydantic's ``ValidationError``."""

    def __init__(self, model: str, errors: list[tuple[str, str, str, Any]]) -> None:
        count = f"{len(errors)} validation error{'s' if len(errors) > 1 else ''} for {model}"
        version = _pydantic_docs_version()
        lines = [count]
        for loc, kind, message, value in errors:
            shown = repr(value)
            if len(shown) > 50:
                shown = f"{shown[:25]}...{shown[-24:]}"
            lines.append(
                f"{loc}\n  {message} [type={kind}, input_value={shown}, input_type={type(value).__name__}]"
            )
            lines.append(
                f"    For further information visit https://errors.pydantic.dev/{version}/v/{kind}"
            )
        super().__init__("\n".join(lines))


_TRUE_WORDS = {"1", "on", "t", "true", "y", "yes"}
_FALSE_WORDS = {"0", "off", "f", "false", "n", "no"}
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")


def _bool(value: Any) -> bool:
    parsing = _Invalid("bool_parsing", "Input should be a valid boolean, unable to interpret input")
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        raise parsing
    if isinstance(value, str):
        if value.lower() in _TRUE_WORDS | _FALSE_WORDS:
            return value.lower() in _TRUE_WORDS
        raise parsing
    raise _Invalid("bool_type", "Input should be a valid boolean")


def _int(value: Any) -> int:
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Invalid("finite_number", "Input should be a finite number")
        if value.is_integer():
            return int(value)
        raise _Invalid(
            "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        )
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text.split(".")[0])
        raise _Invalid(
            "int_parsing", "Input should be a valid integer, unable to parse string as an integer"
        )
    raise _Invalid("int_type", "Input should be a valid integer")


def _float(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
        raise _Invalid(
            "float_parsing", "Input should be a valid number, unable to parse string as a number"
        )
    raise _Invalid("float_type", "Input should be a valid number")


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid("string_type", "Input should be a valid string")


def _enum(values: tuple[str, ...]) -> Callable[[Any], str]:
    quoted = [f"'{v}'" for v in values]
    expected = f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def check(value: Any) -> str:
        if isinstance(value, str) and value in values:
            return value
        raise _Invalid("enum", f"Input should be {expected}")

    return check


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


REQUIRED = object()
"""Default of a field that must be given."""

Spec = dict[str, tuple[Any, Any]]
"""A record: field name -> (check or nested spec or ``("map", key_check, value_spec)``, default)."""

APN_SPEC: Spec = {
    "apn_name": (_enum(APN_NAMES), "internet"),
    "reset_at_reboot": (_bool, False),
    "mms_apn": (_optional(_str), "mms"),
    "mmsc_url": (_optional(_str), "http://mms.carrier.com/mms/wapenc"),
    "mms_proxy": (_optional(_str), None),
    "mms_port": (_optional(_int), None),
}
VPN_SPEC: Spec = {
    "server_address": (_optional(_str), None),
    "protocol": (_optional(_str), None),
    "server_performance": (_enum(PERFORMANCES), "unknown"),
}
PERMISSION_SPEC: Spec = {name: (_bool, False) for name in PERMISSIONS}
APP_SPEC: Spec = {"app_name": (_str, REQUIRED), "permissions": (PERMISSION_SPEC, {})}
DEFAULT_APPS = {
    "messaging": {
        "app_name": "messaging",
        "permissions": {"sms": True, "storage": True, "phone": True},
    },
    "browser": {"app_name": "browser", "permissions": {"network": True, "storage": True}},
}
DEVICE_SPEC: Spec = {
    "sim_card_status": (_enum(SIM_STATUSES), "active"),
    "sim_card_missing": (_bool, False),
    "airplane_mode": (_bool, False),
    "network_signal_strength": (_enum(SIGNALS), "good"),
    "network_technology_connected": (_enum(TECHNOLOGIES), "5G"),
    "network_connection_status": (_enum(NETWORK_STATUSES), "connected"),
    "battery_level": (_int, 80),
    "data_enabled": (_bool, True),
    "roaming_enabled": (_bool, False),
    "network_mode_preference": (_enum(MODES), "4g_5g_preferred"),
    "active_apn_settings": (APN_SPEC, {}),
    "wifi_enabled": (_bool, False),
    "wifi_connected": (_bool, False),
    "wifi_ssid": (_optional(_str), None),
    "wifi_signal_strength": (_enum(SIGNALS), "none"),
    "wifi_calling_enabled": (_bool, False),
    "wifi_calling_mms_over_wifi": (_bool, False),
    "data_saver_mode": (_bool, False),
    "vpn_enabled_setting": (_bool, False),
    "vpn_connected": (_bool, False),
    "vpn_details": (VPN_SPEC, None),
    "app_statuses": (("map", _str, APP_SPEC), DEFAULT_APPS),
}
PAYMENT_SPEC: Spec = {
    "bill_id": (_str, REQUIRED),
    "amount_due": (_float, REQUIRED),
    "paid": (_bool, False),
}
SURROUNDINGS_SPEC: Spec = {
    "name": (_optional(_str), None),
    "phone_number": (_optional(_str), None),
    "is_abroad": (_bool, False),
    "roaming_allowed": (_bool, False),
    "signal_strength": (
        ("map", _enum(TECHNOLOGIES), _enum(SIGNALS)),
        {"2G": "poor", "3G": "fair", "4G": "good", "5G": "excellent"},
    ),
    "mobile_data_usage_exceeded": (_bool, False),
    "line_active": (_bool, True),
    "payment_request": (PAYMENT_SPEC, None),
}
USER_DB_SPEC: Spec = {"device": (DEVICE_SPEC, {}), "surroundings": (SURROUNDINGS_SPEC, {})}


def _check(kind: Any, value: Any, loc: str, errors: list[tuple[str, str, str, Any]]) -> Any:
    """``value`` checked against ``kind`` (a check, a record spec or a map); errors collected."""
    if isinstance(kind, tuple):
        _, key_check, value_kind = kind
        if not isinstance(value, dict):
            errors.append((loc, "dict_type", "Input should be a valid dictionary", value))
            return value
        out = {}
        for key, item in value.items():
            try:
                key = key_check(key)
            except _Invalid as bad:
                errors.append((f"{loc}.{key}.[key]", bad.kind, bad.message, key))
            out[key] = _check(value_kind, item, f"{loc}.{key}", errors)
        return out
    if isinstance(kind, dict):
        return _record(kind, value, loc, errors)
    try:
        return kind(value)
    except _Invalid as bad:
        errors.append((loc, bad.kind, bad.message, value))
        return value


def _record(
    spec: Spec, data: Any, loc: str, errors: list[tuple[str, str, str, Any]]
) -> dict[str, Any]:
    prefix = f"{loc}." if loc else ""
    if not isinstance(data, dict):
        errors.append(
            (
                loc,
                "model_type",
                "Input should be a valid dictionary or object to extract fields from",
                data,
            )
        )
        return {}
    out: dict[str, Any] = {}
    for name, (kind, default) in spec.items():
        value = data.get(name, default)
        if value is REQUIRED:
            errors.append((prefix + name, "missing", "Field required", data))
        elif value is None and default is None:  # an optional field (or record) left empty
            out[name] = None
        else:
            out[name] = _check(kind, copy.deepcopy(value), prefix + name, errors)
    for name, value in data.items():
        if name not in spec:
            errors.append(
                (prefix + name, "extra_forbidden", "Extra inputs are not permitted", value)
            )
    return out


def validate(spec: Spec, data: Any, model: str) -> dict[str, Any]:
    """``data`` as a record of ``spec`` (defaults filled, values coerced as pydantic does)."""
    errors: list[tuple[str, str, str, Any]] = []
    out = _record(spec, data, "", errors)
    if errors:
        raise ValidationError(model, errors)
    return out


def normalise_phone_db(data: dict[str, Any]) -> dict[str, Any]:
    """A user database (``device``, ``surroundings``; either may be partial or absent) in
    upstream's ``TelecomUserDB.model_dump()`` form."""
    return validate(USER_DB_SPEC, data, "TelecomUserDB")


def load_phone_db(path: Path) -> dict[str, Any]:
    """Read ``user_db.toml`` into the normalised form (surroundings default when absent)."""
    with open(path, "rb") as file:
        return normalise_phone_db(tomllib.load(file))


class _Member:
    """Prints as a member of one of upstream's string enums does (in ``check_vpn_status``)."""

    def __init__(self, enum: str, value: str) -> None:
        self.enum, self.value = enum, value

    def __repr__(self) -> str:
        return f"<{self.enum}.{self.value.upper()}: '{self.value}'>"


def _attr(value: Any, name: str) -> Any:
    """``value.name`` as upstream reads a record field: records are dicts here; anything else
    stored where a record belongs fails with Python's ``AttributeError`` text."""
    if isinstance(value, dict):
        return value[name]
    raise AttributeError(f"'{type(value).__name__}' object has no attribute '{name}'")


def _enum_value(value: Any) -> str:
    """``member.value``: a valid enum string is its own value; anything else has none."""
    if isinstance(value, str):
        return value
    raise AttributeError(f"'{type(value).__name__}' object has no attribute 'value'")


def _args(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


APP_NAME_ARG = {"type": "string", "description": "Name of an installed app, e.g. messaging."}
APN_SETTINGS_ARG = {
    "type": "object",
    "description": "The new APN configuration; fields left out take their defaults, other fields are rejected.",
    "properties": {
        "apn_name": {
            "type": "string",
            "enum": list(APN_NAMES),
            "description": "APN name (default internet).",
        },
        "reset_at_reboot": {
            "type": "boolean",
            "description": "Reset the APN at the next reboot (default false).",
        },
        "mms_apn": {"type": ["string", "null"], "description": "APN used for MMS (default mms)."},
        "mmsc_url": {
            "type": ["string", "null"],
            "description": "Address of the MMS center, needed for MMS (default http://mms.carrier.com/mms/wapenc).",
        },
        "mms_proxy": {"type": ["string", "null"], "description": "MMS proxy host (default none)."},
        "mms_port": {"type": ["integer", "null"], "description": "MMS proxy port (default none)."},
    },
    "additionalProperties": False,
}


class PhoneTools(Toolkit):
    """The user's tools on one simulated phone (a deep copy of the given user database)."""

    side = "user"

    def __init__(self, db: dict[str, Any]) -> None:
        self._db = normalise_phone_db(copy.deepcopy(db))
        self._default_vpn = dict(DEFAULT_VPN)
        """The record ``connect_vpn`` installs (shared, not copied: ``break_vpn`` degrades it)."""

    @property
    def _device(self) -> dict[str, Any]:
        device: dict[str, Any] = self._db["device"]
        return device

    @property
    def _around(self) -> dict[str, Any]:
        around: dict[str, Any] = self._db["surroundings"]
        return around

    def state(self) -> dict[str, Any]:
        return self._db

    def update_db(self, data: dict[str, Any] | None) -> None:
        merged = copy.deepcopy(self._db)
        deep_merge(merged, data or {})
        self._db = normalise_phone_db(merged)

    def use(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run a tool; a call that does not fit the signature fails with upstream's class name."""
        try:
            return super().use(name, arguments)
        except TypeError as exc:
            own = f"{type(self).__name__}.{name}()"
            if str(exc).startswith(own):
                raise TypeError(
                    f"TelecomUserTools.{str(exc)[len(type(self).__name__) + 1 :]}"
                ) from None
            raise

    # --- for sync_tools ---

    @property
    def phone_number(self) -> str | None:
        number: str | None = self._around["phone_number"]
        return number

    def sync_line(
        self, *, line_active: bool, roaming_allowed: bool, data_usage_exceeded: bool
    ) -> None:
        """Copy the CRM's facts about the user's line into the surroundings."""
        self._around["line_active"] = line_active
        self._around["roaming_allowed"] = roaming_allowed
        self._around["mobile_data_usage_exceeded"] = data_usage_exceeded

    @property
    def payment_request(self) -> dict[str, Any] | None:
        request: dict[str, Any] | None = self._around["payment_request"]
        return request

    def paid_bill_id(self) -> str | None:
        """The bill id of the payment request once the user has paid it, else ``None``."""
        request = self.payment_request
        return request["bill_id"] if request is not None and request["paid"] else None

    def clear_payment_request(self) -> None:
        self._around["payment_request"] = None

    def request_payment(self, bill_id: str, amount_due: float) -> None:
        """The agent's payment request for ``bill_id`` arrives on the phone (unpaid)."""
        self._around["payment_request"] = {
            "bill_id": bill_id,
            "amount_due": float(amount_due),
            "paid": False,
        }

    # --- the simulation ---

    def simulate_network_search(self) -> None:
        """Re-attach to the cellular network from the SIM, mode preference and surroundings."""
        device, signals = self._device, self._around["signal_strength"]
        if self._sim_status() == "active":
            mode = device[
                "network_mode_preference"
            ]  # any other value (a bad argument) falls back to 4G
            technology = MODE_TECHNOLOGY.get(mode, "4G") if isinstance(mode, str) else "4G"
            if mode == "4g_5g_preferred" and signals.get("5G", "none") != "none":
                technology = "5G"
            device["network_connection_status"] = "connected"
            device["network_technology_connected"] = technology
            device["network_signal_strength"] = signals.get(technology, "none")
        else:
            self._lose_service()
        if device["airplane_mode"]:
            self._lose_service()
        if _attr(device["active_apn_settings"], "apn_name") == "broken":
            self._lose_service()
        if not self._around["line_active"]:
            self._lose_service()

    def _lose_service(self) -> None:
        self._device.update(
            network_connection_status="no_service",
            network_technology_connected="none",
            network_signal_strength="none",
        )

    def _sim_status(self) -> str:
        status: str = (
            "missing" if self._device["sim_card_missing"] else self._device["sim_card_status"]
        )
        return status

    def _mobile_data_working(self) -> bool:
        device, around = self._device, self._around
        if device["airplane_mode"] or device["network_signal_strength"] == "none":
            return False
        if device["network_connection_status"] == "no_service":
            return False
        if around["is_abroad"] and (not device["roaming_enabled"] or not around["roaming_allowed"]):
            return False
        return bool(device["data_enabled"]) and not around["mobile_data_usage_exceeded"]

    def _speed(self) -> tuple[float | None, str]:
        """(Mbps, description) of a speed test; ``(None, "No Connection")`` without data."""
        device = self._device
        if not self._mobile_data_working():
            return None, "No Connection"
        details = device["vpn_details"]
        factor = (
            0.1
            if device["vpn_connected"] and details and details["server_performance"] == "poor"
            else 1.0
        )
        if device["data_saver_mode"]:
            factor *= 0.2
        low, high = SPEED_RANGES.get(device["network_technology_connected"], (0.0, 0.0))
        speed = round(
            (low + high)
            / 2.0
            * SIGNAL_FACTORS.get(device["network_signal_strength"], 0.0)
            * factor,
            2,
        )
        for limit, description in ((1, "Very Poor"), (5, "Poor"), (25, "Fair"), (100, "Good")):
            if speed < limit:
                return speed, description
        return speed, "Excellent"

    def _can_send_mms(self) -> bool:
        device = self._device
        if not self._mobile_data_working() or device["network_technology_connected"] == "2G":
            return False
        if device["wifi_calling_enabled"] and device["wifi_calling_mms_over_wifi"]:
            return False
        if _attr(device["active_apn_settings"], "mmsc_url") is None:
            return False
        messaging = device["app_statuses"].get("messaging")
        if messaging is None:
            return False
        allowed: bool = messaging["permissions"]["storage"] and messaging["permissions"]["sms"]
        return allowed

    def _status_bar(self) -> str:
        device = self._device
        parts = []
        if device["airplane_mode"]:
            parts.append("✈️ Airplane Mode")
        else:
            parts.append(SIGNAL_ICONS.get(device["network_signal_strength"], "📵 No Signal"))
            technology = device["network_technology_connected"]
            if technology != "none":
                parts.append(technology)
            if device["data_enabled"] and technology != "none":
                parts.append("📱 Data Enabled")
                if device["data_saver_mode"]:
                    parts.append("🔽 Data Saver")
            else:
                parts.append("📵 Data Disabled")
        if device["wifi_enabled"] and device["wifi_connected"]:
            parts.append(
                f"📡 Connected to {device['wifi_ssid']}" if device["wifi_ssid"] else "📡 Enabled"
            )
        if device["vpn_connected"]:
            parts.append("🔒 VPN Connected")
        parts.append(f"🔋 {device['battery_level']}%")
        return " | ".join(parts)

    def _with_status_bar(self, text: str) -> str:
        return f"{text}\nStatus Bar: {self._status_bar()}"

    def _flip(self, field: str, search: bool = False) -> bool:
        self._device[field] = not self._device[field]
        if search:
            self.simulate_network_search()
        new: bool = self._device[field]
        return new

    def _disconnect_wifi(self) -> None:
        self._device.update(wifi_connected=False, wifi_ssid=None, wifi_signal_strength="none")

    def _flip_airplane_mode(self) -> bool:
        was_on = self._device["airplane_mode"]
        self._device["airplane_mode"] = not was_on
        if was_on:
            self._device["network_connection_status"] = "searching"
            if self._device["wifi_enabled"]:
                self._disconnect_wifi()
        else:
            self._disconnect_wifi()
            self._disconnect_vpn()
        self.simulate_network_search()
        on: bool = self._device["airplane_mode"]
        return on

    def _disconnect_vpn(self) -> bool:
        if not self._device["vpn_connected"]:
            return False
        self._device.update(vpn_connected=False, vpn_details=None)
        return True

    # --- user tools: status and network ---

    @tool(
        ToolKind.READ,
        "Look at the icons in the phone's status bar: signal, network type, mobile data, Wi-Fi, VPN, battery.",
    )
    def check_status_bar(self) -> str:
        return f"Status Bar: {self._status_bar()}"

    @tool(
        ToolKind.READ,
        "Open the phone's network status: airplane mode, SIM, cellular connection, signal and network type, "
        "whether mobile data and data roaming are enabled, and the Wi-Fi radio and connection.",
    )
    def check_network_status(self) -> str:
        device = self._device
        lines = [
            f"Airplane Mode: {'ON' if device['airplane_mode'] else 'OFF'}",
            f"SIM Card Status: {self._sim_status()}",
            f"Cellular Connection: {device['network_connection_status']}",
            f"Cellular Signal: {device['network_signal_strength']}",
            f"Cellular Network Type: {device['network_technology_connected']}",
            f"Mobile Data Enabled: {'Yes' if device['data_enabled'] else 'No'}",
            f"Data Roaming Enabled: {'Yes' if device['roaming_enabled'] else 'No'}",
            f"Wi-Fi Radio: {'ON' if device['wifi_enabled'] else 'OFF'}",
            f"Wi-Fi Connected: {'Yes' if device['wifi_connected'] else 'No'}",
        ]
        if device["wifi_connected"]:
            lines.append(f"Connected Wi-Fi Network: {device['wifi_ssid']}")
        return "\n".join(lines)

    @tool(ToolKind.READ, "See which cellular network mode the phone prefers.")
    def check_network_mode_preference(self) -> str:
        return f"Network Mode Preference: {_enum_value(self._device['network_mode_preference'])}"

    @tool(
        ToolKind.WRITE,
        "Choose which cellular network type the phone prefers (faster 4G/5G or older 3G/2G); the phone then "
        "searches for a network again.",
        _args(
            ["mode"],
            mode={
                "type": "string",
                "enum": list(MODES),
                "description": "The preferred network mode.",
            },
        ),
    )
    def set_network_mode_preference(self, mode: Any) -> str:
        if isinstance(mode, str) and mode not in MODES:
            return self._with_status_bar(
                f"Failed to set network mode: '{mode}' is not a valid option. Please use one of: {', '.join(MODES)}"
            )
        self._device["network_mode_preference"] = mode
        self.simulate_network_search()
        if mode is None:  # upstream takes a stored None for a rejected mode
            return self._with_status_bar(
                f"Failed to set network mode: 'None' is not a valid option. Please use one of: {', '.join(MODES)}"
            )
        return self._with_status_bar(f"Preferred Network Mode set to: {_enum_value(mode)}")

    @tool(
        ToolKind.READ,
        "Test the download speed of the phone's mobile data and say what it is good for.",
    )
    def run_speed_test(self) -> str:
        speed, description = self._speed()
        if speed is None:
            return f"Speed test failed: {description or 'Could not determine speed'}."
        return f"Speed Test Result: {speed:.2f} Mbps ({description}). {SPEED_ADVICE.get(description, '')}"

    @tool(
        ToolKind.WRITE,
        "Switch airplane mode on or off (on cuts cellular, Wi-Fi and other radios); reports the new setting.",
    )
    def toggle_airplane_mode(self) -> str:
        on = self._flip_airplane_mode()
        return self._with_status_bar(f"Airplane Mode is now {'ON' if on else 'OFF'}.")

    def turn_airplane_mode_on(self) -> str:
        if not self._flip_airplane_mode():
            self._flip_airplane_mode()
        return "Airplane Mode is now ON."

    def turn_airplane_mode_off(self) -> str:
        if self._flip_airplane_mode():
            self._flip_airplane_mode()
        return "Airplane Mode is now OFF."

    # --- SIM ---

    @tool(
        ToolKind.READ,
        "See whether the SIM card works: active, missing, or locked by a PIN or PUK code.",
    )
    def check_sim_status(self) -> str:
        status = self._sim_status()
        return SIM_TEXTS.get(status, f"Unknown SIM status: {status}")

    @tool(
        ToolKind.WRITE,
        "Take the SIM card out and put it back in, which can fix a SIM that is not recognised.",
    )
    def reseat_sim_card(self) -> str:
        self._device["sim_card_missing"] = False
        self.simulate_network_search()
        return self._with_status_bar("SIM card re-seated successfully.")

    def unseat_sim_card(self) -> str:
        self._device["sim_card_missing"] = True
        self.simulate_network_search()
        return "SIM card un-seated successfully."

    def lock_sim_card(self, mode: str) -> str:
        if mode in ("pin", "puk"):
            self._device["sim_card_status"] = f"locked_{mode}"
        self.simulate_network_search()
        return f"SIM card locked successfully in {mode} mode."

    # --- mobile data, roaming, data saver ---

    @tool(ToolKind.WRITE, "Switch mobile (cellular) data on or off; reports the new setting.")
    def toggle_data(self) -> str:
        on = self._flip("data_enabled", search=True)
        return self._with_status_bar(f"Mobile Data is now {'ON' if on else 'OFF'}.")

    def turn_data_on(self) -> str:
        self._device["data_enabled"] = True
        return "Data connection restored."

    def turn_data_off(self) -> str:
        if self._flip("data_enabled", search=True):
            self._flip("data_enabled", search=True)
        return "Data connection broken."

    @tool(
        ToolKind.WRITE,
        "Switch data roaming on or off (on lets the phone use data on other networks, e.g. abroad).",
    )
    def toggle_roaming(self) -> str:
        on = self._flip("roaming_enabled", search=True)
        return self._with_status_bar(f"Data Roaming is now {'ON' if on else 'OFF'}.")

    def turn_roaming_on(self) -> str:
        if not self._flip("roaming_enabled", search=True):
            self._flip("roaming_enabled", search=True)
        return "Data Roaming is now ON."

    def turn_roaming_off(self) -> str:
        if self._flip("roaming_enabled", search=True):
            self._flip("roaming_enabled", search=True)
        return "Data Roaming is now OFF."

    @tool(ToolKind.READ, "See whether a data-limiting feature (Data Saver) is switched on.")
    def check_data_restriction_status(self) -> str:
        if self._device["data_saver_mode"]:
            return "Data Saver mode is ON (limits data usage)."
        return "Data Saver mode is OFF."

    @tool(
        ToolKind.WRITE,
        "Switch Data Saver on or off (on uses less data and can slow it down); reports the new setting.",
    )
    def toggle_data_saver_mode(self) -> str:
        on = self._flip("data_saver_mode")
        return self._with_status_bar(f"Data Saver Mode is now {'ON' if on else 'OFF'}.")

    def turn_data_saver_mode_on(self) -> str:
        if not self._flip("data_saver_mode"):
            self._flip("data_saver_mode")
        return "Data Saver Mode is now ON."

    def turn_data_saver_mode_off(self) -> str:
        if self._flip("data_saver_mode"):
            self._flip("data_saver_mode")
        return "Data Saver Mode is now OFF."

    # --- APN ---

    @tool(
        ToolKind.READ,
        "Show the APN (carrier data connection) name and the MMSC address used for picture messages.",
    )
    def check_apn_settings(self) -> str:
        apn = self._device["active_apn_settings"]
        if not isinstance(apn, dict):
            _attr(apn, "model_copy")
        name = apn["apn_name"] or "Not Set"
        return (
            f"Current APN Name: {name}\nMMSC URL (for picture messages): {apn['mmsc_url'] or 'Not Set'}\n"
            "(These are technical settings, usually best left unchanged.)"
        )

    @tool(
        ToolKind.WRITE,
        "Replace the phone's APN settings.",
        _args(["apn_settings"], apn_settings=APN_SETTINGS_ARG),
    )
    def set_apn_settings(self, apn_settings: Any) -> str:
        if isinstance(apn_settings, dict):
            apn_settings = validate(APN_SPEC, apn_settings, "APNSettings")
        self._device["active_apn_settings"] = apn_settings
        text = f"APN settings set to: {_attr(apn_settings, 'apn_name')}"
        self.simulate_network_search()
        return self._with_status_bar(text)

    @tool(
        ToolKind.WRITE,
        "Put the APN settings back to their defaults (this takes effect at the next reboot).",
    )
    def reset_apn_settings(self) -> str:
        apn = self._device["active_apn_settings"]
        if not isinstance(apn, dict):
            raise AttributeError(
                f"'{type(apn).__name__}' object has no attribute 'reset_at_reboot'"
            )
        apn["reset_at_reboot"] = True
        self.simulate_network_search()
        return self._with_status_bar("APN settings will reset at reboot.")

    def break_apn_settings(self) -> str:
        _attr(self._device["active_apn_settings"], "apn_name")
        self._device["active_apn_settings"]["apn_name"] = "broken"
        self.simulate_network_search()
        return "APN settings broken. Please call reset_apn_settings() to fix."

    def break_apn_mms_setting(self) -> str:
        _attr(self._device["active_apn_settings"], "mmsc_url")
        self._device["active_apn_settings"]["mmsc_url"] = None
        return "APN MMS setting broken. Please call reset_apn_settings() to fix."

    # --- Wi-Fi and Wi-Fi calling ---

    @tool(
        ToolKind.READ,
        "See whether Wi-Fi is on, which network it is connected to and how strong its signal is.",
    )
    def check_wifi_status(self) -> str:
        device = self._device
        if not device["wifi_enabled"]:
            return "Wi-Fi is turned OFF."
        if device["wifi_connected"]:
            return f"Wi-Fi is ON and connected to '{device['wifi_ssid']}'. Signal strength: {device['wifi_signal_strength']}."
        return "Wi-Fi is ON but not connected to any network."

    @tool(
        ToolKind.WRITE,
        "Switch the Wi-Fi radio on or off (not possible in airplane mode); reports the new setting.",
    )
    def toggle_wifi(self) -> str:
        if self._device["airplane_mode"]:
            return self._with_status_bar("Cannot change Wi-Fi settings while Airplane Mode is ON.")
        on = self._flip("wifi_enabled")
        if not on:
            self._disconnect_wifi()
        return self._with_status_bar(f"Wi-Fi is now {'ON' if on else 'OFF'}.")

    @tool(
        ToolKind.READ,
        "See whether Wi-Fi Calling (calls over Wi-Fi instead of the cellular network) is on.",
    )
    def check_wifi_calling_status(self) -> str:
        return f"Wi-Fi Calling is currently turned {'ON' if self._device['wifi_calling_enabled'] else 'OFF'}."

    @tool(
        ToolKind.WRITE,
        "Switch Wi-Fi Calling on or off (helps where the cellular signal is weak); reports the new setting.",
    )
    def toggle_wifi_calling(self) -> str:
        on = self._flip("wifi_calling_enabled")
        return self._with_status_bar(f"Wi-Fi Calling is now {'ON' if on else 'OFF'}.")

    def set_wifi_calling(self, enabled: Any, mms_over_wifi: Any = None) -> str:
        if self._device["wifi_calling_enabled"] != enabled:
            self._flip("wifi_calling_enabled")
        text = f"Wi-Fi Calling is now {'ON' if enabled else 'OFF'}."
        if mms_over_wifi is not None:
            self._device["wifi_calling_mms_over_wifi"] = mms_over_wifi
            text += f"\nMMS over Wi-Fi is now {'ON' if mms_over_wifi else 'OFF'}."
        return text

    # --- VPN ---

    @tool(
        ToolKind.READ, "See whether a VPN is set up and connected, with the connection's details."
    )
    def check_vpn_status(self) -> str:
        device = self._device
        if device["vpn_connected"]:
            details = device["vpn_details"]
            if details:
                shown = dict(
                    details,
                    server_performance=_Member("PerformanceLevel", details["server_performance"]),
                )
                return f"VPN is ON and connected. Details: {shown}"
            return "VPN is ON and connected (no specific details available)."
        if device["vpn_enabled_setting"]:
            return "VPN is turned ON in settings, but currently not connected."
        return "VPN is turned OFF."

    @tool(ToolKind.WRITE, "Connect the phone's VPN.")
    def connect_vpn(self) -> str:
        if self._device["vpn_connected"]:
            return "VPN already connected."
        self._device.update(vpn_connected=True, vpn_details=self._default_vpn)
        return self._with_status_bar("VPN connected successfully.")

    @tool(
        ToolKind.WRITE,
        "Disconnect the active VPN, so traffic no longer goes through the VPN server.",
    )
    def disconnect_vpn(self) -> str:
        done = self._disconnect_vpn()
        return self._with_status_bar(
            "VPN disconnected successfully." if done else "No active VPN connection to disconnect."
        )

    def break_vpn(self) -> str:
        self.connect_vpn()
        details = self._device["vpn_details"]
        if details is None:
            raise AttributeError("'NoneType' object has no attribute 'server_performance'")
        details["server_performance"] = "poor"
        return "VPN connection broken."

    # --- apps ---

    @tool(ToolKind.READ, "List the apps installed on the phone.")
    def check_installed_apps(self) -> str:
        return f"The following apps are installed on the phone: {', '.join(self._device['app_statuses'])}"

    def _granted(self, app: dict[str, Any]) -> list[str]:
        return [
            name.replace("_", " ").lower()
            for name, allowed in app["permissions"].items()
            if allowed
        ]

    @tool(
        ToolKind.READ,
        "Show an app's details, including the permissions it has been granted.",
        _args(["app_name"], app_name=APP_NAME_ARG),
    )
    def check_app_status(self, app_name: Any) -> str:
        app = self._device["app_statuses"].get(app_name)
        if not app:
            return f"App '{app_name}' not found on this phone."
        granted = self._granted(app)
        lines = [f"Status for App: {app_name}"]
        if granted:
            lines += [" - Permissions Granted:", *(f"   - {name}" for name in granted)]
        else:
            lines.append(" - Permissions: None granted.")
        return "\n".join(lines)

    @tool(
        ToolKind.READ,
        "Show which permissions (sms, storage, phone, network) an app currently has.",
        _args(["app_name"], app_name=APP_NAME_ARG),
    )
    def check_app_permissions(self, app_name: Any) -> str:
        app = self._device["app_statuses"].get(app_name)
        if not app:
            return f"App '{app_name}' not found on this phone."
        granted = self._granted(app)
        if not granted:
            return f"App '{app_name}' currently has no permissions granted."
        return f"App '{app_name}' has permission for: {', '.join(granted)}."

    @tool(
        ToolKind.WRITE,
        "Give an app one permission, which some of its features need.",
        _args(
            ["app_name", "permission"],
            app_name={"type": "string", "description": "The app that gets the permission."},
            permission={
                "type": "string",
                "description": "The permission in lowercase: sms, storage, phone or network.",
            },
        ),
    )
    def grant_app_permission(self, app_name: Any, permission: Any) -> str:
        app = self._device["app_statuses"].get(app_name)
        permission = permission.lower()
        if not app:
            text = f"Error. App '{app_name}' not found. Cannot grant permission."
        elif permission not in app["permissions"]:
            text = (
                f"Error. Permission '{permission}' not tracked for app '{app_name}', "
                f"available permissions: {list(app['permissions'])}"
            )
        else:
            app["permissions"][permission] = True
            text = f"Success. Permission '{permission}' granted to app '{app_name}'."
        return self._with_status_bar(text)

    def remove_app_permission(self, app_name: Any, permission: Any) -> tuple[bool, str]:
        app = self._device["app_statuses"].get(app_name)
        permission = permission.lower()
        if not app:
            return False, f"App '{app_name}' not found. Cannot remove permission."
        if permission not in app["permissions"]:
            return False, f"Permission '{permission}' not tracked for app '{app_name}'."
        app["permissions"][permission] = False
        return True, f"Permission '{permission}' removed from app '{app_name}'."

    @tool(ToolKind.READ, "Check whether the default messaging app can send MMS (picture) messages.")
    def can_send_mms(self) -> str:
        if self._can_send_mms():
            return "Your messaging app can send MMS messages."
        return "Your messaging app cannot send MMS messages."

    # --- device, payment ---

    @tool(
        ToolKind.WRITE,
        "Restart the phone, which restarts its network services (and applies a pending APN reset).",
    )
    def reboot_device(self) -> str:
        lines = []
        if _attr(self._device["active_apn_settings"], "reset_at_reboot"):
            lines.append("Resetting APN settings...")
            self._device["active_apn_settings"] = validate(APN_SPEC, {}, "APNSettings")
        lines.append("Restarting network services...")
        self._device["network_connection_status"] = "searching"
        self.simulate_network_search()
        return self._with_status_bar("\n".join(lines))

    @tool(ToolKind.READ, "Check whether the agent has sent a payment request to the phone.")
    def check_payment_request(self) -> str:
        request = self.payment_request
        if request is None:
            return "No payment request has been made."
        return f"You have a payment request for bill {request['bill_id']} of {request['amount_due']} USD."

    @tool(ToolKind.WRITE, "Pay the bill of the payment request the agent sent.")
    def make_payment(self) -> str:
        request = self.payment_request
        if request is None:
            return "You do not have a payment request."
        request["paid"] = True
        return (
            f"Payment of {request['amount_due']} USD has been made for bill {request['bill_id']}."
        )

    # --- scenario set-up (initialisation actions) ---

    def set_user_info(self, name: Any, phone_number: Any) -> None:
        self._around.update(name=name, phone_number=phone_number)

    def set_user_location(self, abroad: Any) -> None:
        self._around["is_abroad"] = abroad

    # --- assertions (env_assertions) ---

    def assert_airplane_mode_status(self, expected_status: Any) -> bool:
        return bool(self._device["airplane_mode"] == expected_status)

    def assert_service_status(self, expected_status: Any) -> bool:
        if expected_status not in NETWORK_STATUSES:
            raise ValueError(f"{expected_status!r} is not a valid NetworkStatus")
        return bool(self._device["network_connection_status"] == expected_status)

    def assert_mobile_data_status(self, expected_status: Any) -> bool:
        return bool(self._mobile_data_working() == expected_status)

    def assert_mobile_roaming_status(self, expected_status: Any) -> bool:
        return bool(self._device["roaming_enabled"] == expected_status)

    def assert_mobile_data_saver_mode_status(self, expected_status: Any) -> bool:
        return bool(self._device["data_saver_mode"] == expected_status)

    def assert_internet_speed(self, expected_speed: Any, expected_desc: Any = None) -> bool:
        speed, description = self._speed()
        speed = speed or 0.0
        if expected_desc is None:
            return bool(speed >= expected_speed)
        return bool(speed >= expected_speed and description.lower() == expected_desc.lower())

    def assert_internet_not_excellent(self) -> bool:
        return self._speed()[1].lower() != "excellent"

    def assert_can_send_mms(self, expected_status: Any) -> bool:
        return bool(self._can_send_mms() == expected_status)

    def assert_mobile_data_usage_exceeded(self, expected_status: Any) -> bool:
        return bool(self._around["mobile_data_usage_exceeded"] == expected_status)
