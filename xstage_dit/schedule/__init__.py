"""Every schedule choice, each with its reason: attention fused/serial, the MoE tile order and lead.

Fed the calibrated `XStageParams` and `DeviceFacts` read off the device; imports `xstage` and nothing
above it. One module per chooser: `attention`, `moe` (with `moe_tiles`, the tile order it builds); `choices` holds `ScheduleChoice`.
"""

from xstage_dit.schedule.attention import choose_attention_schedule
from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe import MoESchedule, MoEScheduler, choose_moe_lead, choose_moe_path, choose_moe_schedule

__all__ = ["DeviceFacts", "ScheduleChoice", "choose_attention_schedule", "MoESchedule", "MoEScheduler",
           "choose_moe_lead", "choose_moe_path", "choose_moe_schedule"]
