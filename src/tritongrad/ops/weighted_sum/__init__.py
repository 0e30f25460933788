from .launch import weighted_sum
from .reference import weighted_sum_reference

__all__ = ["weighted_sum", "weighted_sum_reference"]
