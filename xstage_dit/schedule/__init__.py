"""Every schedule choice, each with its reason: attention fused/serial, the MoE tile order and lead.

Fed the calibrated `XStageParams` and `DeviceFacts` read off the device; imports `xstage` and nothing
above it. One module per chooser: `attention`, `moe_tiles`; `choices` holds `ScheduleChoice`.
"""

from xstage_dit.schedule.attention import choose_attention_schedule
from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe_tiles import choose_moe_lead

__all__ = ["DeviceFacts", "ScheduleChoice", "choose_attention_schedule", "choose_moe_lead"]
