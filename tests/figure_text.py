"""Read a matplotlib figure's text back, as a reader would see it: titles, legends, and whether any text is
cut off at the figure's edge or drawn over another tick label of the same axis."""
from __future__ import annotations


def _texts(fig):
    """Every text the last draw showed: tick labels only where their tick is in view (matplotlib keeps
    label objects for ticks outside the view limits too)."""
    from matplotlib.text import Text
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks |= {id(tick.label1), id(tick.label2)}
            drawn += drawn_tick_labels(axis)
    return [t for t in fig.findobj(Text) if id(t) not in ticks and t.get_visible() and t.get_text().strip()] + drawn


def drawn_tick_labels(axis) -> list:
    """The tick labels (major and minor) of ``axis`` that the last draw put on the figure."""
    return [t.label1 for t in axis._update_ticks() if t.label1.get_visible() and t.label1.get_text().strip()]


def text_problems(fig) -> list[str]:
    """Every text cut off by the figure's edge, and every pair of drawn tick labels of one axis that overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    problems = []
    for text in _texts(fig):
        box = text.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            problems.append(f"cut off at the edge: {text.get_text()!r}")
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = drawn_tick_labels(axis)
            boxes = [(label.get_text(), label.get_window_extent(renderer)) for label in labels]
            for i, (a, box_a) in enumerate(boxes):
                for b, box_b in boxes[i + 1:]:
                    if box_a.overlaps(box_b):
                        problems.append(f"tick labels {a!r} and {b!r} overlap")
    return problems


def legend_texts(fig) -> list[str]:
    """Every legend entry of the figure and its axes."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def legends_over_axes(fig) -> list[str]:
    """Legends drawn inside an axes' plotting area (over its data)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for legend in list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if box.overlaps(ax.bbox):
                out.append(f"legend {[t.get_text() for t in legend.get_texts()][:3]} over an axes")
    return out
