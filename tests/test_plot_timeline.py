"""tools/plot_memory.py's timeline of a run whose requests arrived over time: the counts of
requests arrived, given their first token and complete, against a hand-made run."""

from tools.plot_memory import arrived_over_time, draw_arrivals, plt


def test_the_timeline_counts_arrivals_first_tokens_and_completions():
    run = {"requests": [{"arrival_seconds": 0.0, "token_seconds": [0.5, 0.7]},
                        {"arrival_seconds": 0.3, "token_seconds": [0.9, 1.0, 1.4]},
                        {"arrival_seconds": 0.2, "token_seconds": []}]}  # no token yet
    assert arrived_over_time(run)
    fig, ax = plt.subplots()
    draw_arrivals(ax, run)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines == {"arrived": ([0.0, 0.2, 0.3], [1, 2, 3]), "first token": ([0.5, 0.9], [1, 2]),
                     "complete": ([0.7, 1.4], [1, 2])}
    plt.close(fig)


def test_runs_with_every_request_at_the_start_draw_no_timeline():
    assert not arrived_over_time({"requests": [{"arrival_seconds": 0.0, "token_seconds": [1.0]}]})
    assert not arrived_over_time({"timeline": []})  # a run without requests
