"""ModelReportVisualizer: tables (tabulate) and plots (matplotlib, optional) of a ModelReport's features."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["ModelReportVisualizer", "TABLE_CHANNEL_KEY", "TABLE_TENSOR_KEY"]

TABLE_TENSOR_KEY = "tensor_level_info"
TABLE_CHANNEL_KEY = "channel_level_info"


def _is_per_channel(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1
    return isinstance(value, (list, tuple))


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _plottable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (int, float)) for v in value)
    return isinstance(value, (int, float))


class ModelReportVisualizer:
    """Views of {layer fqn: {feature: value}} from ModelReport.generate_visualizer()."""

    TABLE_TENSOR_KEY = TABLE_TENSOR_KEY
    TABLE_CHANNEL_KEY = TABLE_CHANNEL_KEY
    NUM_NON_FEATURE_TENSOR_HEADERS = 2    # idx, layer_fqn
    NUM_NON_FEATURE_CHANNEL_HEADERS = 3   # idx, layer_fqn, channel
    CHANNEL_NUM_INDEX = 2                 # where the channel number sits in a channel row

    def __init__(self, generated_reports: dict[str, dict[str, Any]]) -> None:
        self.generated_reports = dict(generated_reports)

    def get_all_unique_module_fqns(self) -> set[str]:
        """Every layer fqn in the report."""
        return set(self.generated_reports)

    def get_all_unique_feature_names(self, plottable_features_only: bool = True) -> set[str]:
        """Every feature name (only tensor-valued ones when plottable_features_only, as torch.ao does)."""
        names: set[str] = set()
        for features in self.generated_reports.values():
            names.update(k for k, v in features.items() if not plottable_features_only or type(v) is torch.Tensor)
        return names

    def _filtered(self, feature_filter: str, module_fqn_filter: str) -> dict[str, dict[str, Any]]:
        return {fqn: {k: v for k, v in features.items() if feature_filter in k}
                for fqn, features in self.generated_reports.items() if module_fqn_filter in fqn}

    def generate_filtered_tables(self, feature_filter: str = "", module_fqn_filter: str = "") -> dict[str, tuple]:
        """{"tensor_level_info": (headers, rows), "channel_level_info": (headers, rows)}; filters are substrings."""
        data = self._filtered(feature_filter, module_fqn_filter)
        tensor_features = sorted({k for f in data.values() for k, v in f.items() if not _is_per_channel(v)})
        channel_features = sorted({k for f in data.values() for k, v in f.items() if _is_per_channel(v)})
        tensor_rows = [[index, fqn] + [_scalar(features.get(k, "Not Applicable")) for k in tensor_features]
                       for index, (fqn, features) in enumerate(data.items()) if tensor_features]
        channel_rows: list[list[Any]] = []
        for fqn, features in data.items():
            lengths = [len(features[k]) for k in channel_features if k in features]
            for channel in range(max(lengths, default=0)):
                row: list[Any] = [len(channel_rows), fqn, channel]
                for k in channel_features:
                    values = features.get(k)
                    row.append(_scalar(values[channel]) if values is not None and channel < len(values)
                               else "Not Applicable")
                channel_rows.append(row)
        tensor_headers = ["idx", "layer_fqn"] + tensor_features if tensor_rows else []
        channel_headers = ["idx", "layer_fqn", "channel"] + channel_features if channel_rows else []
        return {TABLE_TENSOR_KEY: (tensor_headers, tensor_rows), TABLE_CHANNEL_KEY: (channel_headers, channel_rows)}

    def generate_table_visualization(self, feature_filter: str = "", module_fqn_filter: str = "") -> str:
        """Both tables as text (also printed)."""
        from tabulate import tabulate

        tables = self.generate_filtered_tables(feature_filter, module_fqn_filter)
        parts = []
        for title, key in (("Tensor-level information", TABLE_TENSOR_KEY),
                           ("Channel-level information", TABLE_CHANNEL_KEY)):
            headers, rows = tables[key]
            parts.append(f"{title}\n" + (tabulate(rows, headers=headers) if rows else "no data"))
        text = "\n\n".join(parts)
        print(text)
        return text

    def _series(self, feature_filter: str, module_fqn_filter: str) -> tuple[list[str], list[list[float]]]:
        data = self._filtered(feature_filter, module_fqn_filter)
        labels, series = [], []
        for fqn, features in data.items():
            for name, value in features.items():
                if _plottable(value):
                    values = value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else (
                        list(value) if isinstance(value, (list, tuple)) else [value])
                    labels.append(f"{fqn}: {name}")
                    series.append([float(v) for v in values])
        if not series:
            raise ValueError(f"no plottable feature matches feature_filter={feature_filter!r}, "
                             f"module_fqn_filter={module_fqn_filter!r}")
        return labels, series

    def generate_plot_visualization(self, feature_filter: str, module_fqn_filter: str = "",
                                    path: str = "model_report_plot.png") -> str:
        """A line plot of the matching features (per channel, or per layer for scalars), saved as PNG."""
        plt = _pyplot()
        labels, series = self._series(feature_filter, module_fqn_filter)
        figure, axes = plt.subplots(figsize=(8, 4.5))
        if all(len(s) == 1 for s in series):
            axes.plot(range(len(series)), [s[0] for s in series], marker="o")
            axes.set_xticks(range(len(series)), labels, rotation=45, ha="right", fontsize=7)
        else:
            for label, values in zip(labels, series):
                axes.plot(range(len(values)), values, label=label)
            axes.set_xlabel("channel")
            axes.legend(fontsize=7)
        axes.set_title(feature_filter or "features")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return path

    def generate_histogram_visualization(self, feature_filter: str, module_fqn_filter: str = "", num_bins: int = 10,
                                         path: str = "model_report_histogram.png") -> str:
        """A histogram of every value of the matching features, saved as PNG."""
        plt = _pyplot()
        _, series = self._series(feature_filter, module_fqn_filter)
        values = [v for s in series for v in s if v == v and abs(v) != float("inf")]
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.hist(values, bins=num_bins)
        axes.set_title(f"{feature_filter} ({len(values)} values)")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'pytest-qreport[plot]' "
                          "(or pip install matplotlib)") from None
    return plt
