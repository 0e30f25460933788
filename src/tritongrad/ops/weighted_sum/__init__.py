from .launch import column_sums, weighted_sum
from .reference import weighted_sum_reference

__all__ = ["column_sums", "weighted_sum", "weighted_sum_reference"]
