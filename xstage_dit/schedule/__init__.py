"""Every schedule choice, each with its reason: attention fused/serial, the MoE tile order and lead.

Fed the calibrated `XStageParams` and facts read off the device; imports `xstage` and nothing above it.
"""

from xstage_dit.schedule.choices import ScheduleChoice, choose_attention_schedule
from xstage_dit.schedule.moe import MoESchedule, MoEScheduler, choose_moe_lead, choose_moe_path, choose_moe_schedule

__all__ = ["ScheduleChoice", "choose_attention_schedule", "MoESchedule", "MoEScheduler", "choose_moe_lead",
           "choose_moe_path", "choose_moe_schedule"]
