"""Every schedule choice, each with its reason: attention fused/serial, the MoE tile order and lead.

Fed the calibrated `XStageParams` and facts read off the device; imports `xstage` and nothing above it.
"""

from xstage_dit.schedule.choices import ScheduleChoice, choose_attention_schedule, choose_moe_lead

__all__ = ["ScheduleChoice", "choose_attention_schedule", "choose_moe_lead"]
