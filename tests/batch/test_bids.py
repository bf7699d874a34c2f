"""otreg.batch.bids: inputs found in fMRIPrep derivatives and FreeSurfer SUBJECTS_DIRs, pairs
named as BIDS derivatives, the derivative dataset_description.json."""

import json
import re
import sqlite3
import sys
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from otreg import load_shape
from otreg.batch import (
    SubjectInput,
    bids_pairs,
    find_inputs,
    write_dataset_description,
)
from otreg.batch.manifest import check_pair_id

TETRA = np.array([[0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]], dtype=np.float32)
FACES = np.array([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]], dtype=np.int32)
CRAS = np.array([5.0, -3.0, 12.0])
NAME = re.compile(
    r"sub-(?P<sub>[A-Za-z0-9]+)(_ses-(?P<ses>[A-Za-z0-9]+))?(_hemi-[LR])?"
    r"_space-[A-Za-z0-9]+(_label-[0-9]+)?_desc-otreg_"
)


def gifti(path: Path, shift: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = [
        nib.gifti.GiftiDataArray(TETRA + shift, intent="NIFTI_INTENT_POINTSET"),
        nib.gifti.GiftiDataArray(FACES, intent="NIFTI_INTENT_TRIANGLE"),
    ]
    nib.save(nib.GiftiImage(darrays=arrays), str(path))
    return path


def dseg(path: Path, mgz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.zeros((8, 8, 8), dtype=np.int32)
    data[2:6, 2:6, 2:6] = 17
    data[3:5, 3:5, 6:8] = 53
    image = (nib.MGHImage if mgz else nib.Nifti1Image)(data, np.eye(4))
    nib.save(image, str(path))
    return path


def freesurfer(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "head": np.array([2, 0, 20], dtype=np.int32),
        "valid": "1  # volume info valid",
        "filename": "T1.mgz",
        "volume": np.array([256, 256, 256]),
        "voxelsize": np.ones(3),
        "xras": np.array([-1.0, 0, 0]),
        "yras": np.array([0, 0, -1.0]),
        "zras": np.array([0, 1.0, 0]),
        "cras": CRAS,
    }
    nib.freesurfer.write_geometry(str(path), TETRA.astype(float), FACES, volume_info=info)
    return path


def description(root: Path, **fields) -> None:
    root.mkdir(parents=True, exist_ok=True)
    info = {"Name": "x", "BIDSVersion": "1.8.0", **fields}
    (root / "dataset_description.json").write_text(json.dumps(info))


def fmriprep_tree(root: Path, subjects=(("01", None), ("02", "1"), ("02", "2"), ("03", None))):
    """sub-01; sub-02 with two sessions; sub-03 without its right hemisphere; decoys."""
    description(root, DatasetType="derivative", GeneratedBy=[{"Name": "fMRIPrep"}])
    for sub, ses in subjects:
        anat = root / f"sub-{sub}" / (f"ses-{ses}" if ses else "") / "anat"
        stem = f"sub-{sub}" + (f"_ses-{ses}" if ses else "")
        for hemi in ("L",) if sub == "03" else ("L", "R"):
            for surf in ("pial", "white"):
                gifti(anat / f"{stem}_hemi-{hemi}_{surf}.surf.gii")
            gifti(anat / f"{stem}_hemi-{hemi}_space-fsLR_den-32k_pial.surf.gii")
            gifti(anat / f"{stem}_hemi-{hemi}_desc-reg_sphere.surf.gii")
            gifti(anat / f"{stem}_hemi-{hemi}_desc-smoothed_pial.surf.gii")
        dseg(anat / f"{stem}_desc-aseg_dseg.nii.gz")
        dseg(anat / f"{stem}_desc-aparcaseg_dseg.nii.gz")
        func = anat.parent / "func"
        func.mkdir()
        (func / f"{stem}_task-rest_hemi-L_space-fsaverage_bold.func.gii").write_bytes(b"")
    freesurfer(root / "sourcedata" / "freesurfer" / "sub-09" / "surf" / "lh.pial")
    return root


def freesurfer_tree(root: Path) -> Path:
    for folder in ("sub-01", "OAS1_0002", "fsaverage", "fsaverage5"):
        for h in ("lh", "rh"):
            freesurfer(root / folder / "surf" / f"{h}.pial")
        dseg(root / folder / "mri" / "aseg.mgz", mgz=True)
    (root / "notes").mkdir()
    return root


def summary(inputs):
    return [(i.subject, i.session, i.hemisphere, i.kind, i.path.name) for i in inputs]


def check_names(pairs):
    for p in pairs:
        assert check_pair_id(p.pair_id) == p.pair_id
        m = NAME.fullmatch(p.prefix)
        assert m, p.prefix
        folder = f"sub-{m['sub']}/" + (f"ses-{m['ses']}/" if m["ses"] else "") + "anat"
        assert p.folder == folder
        assert p.prefix.startswith(p.pair_id.rsplit("_label-", 1)[0])


@pytest.fixture
def derivatives(tmp_path):
    return fmriprep_tree(tmp_path / "fmriprep")


@pytest.fixture
def templates(tmp_path):
    return {
        "L": gifti(tmp_path / "tpl" / "tpl_hemi-L_pial.surf.gii"),
        "R": gifti(tmp_path / "tpl" / "tpl_hemi-R_pial.surf.gii", shift=1.0),
        "seg": dseg(tmp_path / "tpl" / "tpl_dseg.nii.gz"),
    }


# ----------------------------------------------------------------------------- fMRIPrep


def test_fmriprep_surfaces_and_their_pairs(derivatives, templates):
    with pytest.warns(UserWarning, match=r"1 input\(s\) missing.*sub-03_hemi-R"):
        inputs = find_inputs(derivatives)
    assert summary(inputs) == [
        ("01", None, "L", "surface", "sub-01_hemi-L_pial.surf.gii"),
        ("01", None, "R", "surface", "sub-01_hemi-R_pial.surf.gii"),
        ("02", "1", "L", "surface", "sub-02_ses-1_hemi-L_pial.surf.gii"),
        ("02", "1", "R", "surface", "sub-02_ses-1_hemi-R_pial.surf.gii"),
        ("02", "2", "L", "surface", "sub-02_ses-2_hemi-L_pial.surf.gii"),
        ("02", "2", "R", "surface", "sub-02_ses-2_hemi-R_pial.surf.gii"),
        ("03", None, "L", "surface", "sub-03_hemi-L_pial.surf.gii"),
    ]
    assert inputs[2].path == derivatives / "sub-02/ses-1/anat/sub-02_ses-1_hemi-L_pial.surf.gii"
    assert load_shape(inputs[0].path).n_points == 4

    pairs = bids_pairs(inputs, {"L": templates["L"], "R": str(templates["R"])}, "fsaverage")
    assert [p.pair_id for p in pairs] == [
        "sub-01_hemi-L",
        "sub-01_hemi-R",
        "sub-02_ses-1_hemi-L",
        "sub-02_ses-1_hemi-R",
        "sub-02_ses-2_hemi-L",
        "sub-02_ses-2_hemi-R",
        "sub-03_hemi-L",
    ]
    p = pairs[3]
    assert p.folder == "sub-02/ses-1/anat"
    assert p.prefix == "sub-02_ses-1_hemi-R_space-fsaverage_desc-otreg_"
    assert (p.source_subject, p.target_subject, p.hemisphere, p.label) == (
        "02",
        "fsaverage",
        "R",
        None,
    )
    assert p.source == str(inputs[3].path) and p.target == str(templates["R"])
    assert pairs[0].folder == "sub-01/anat" and pairs[0].target == str(templates["L"])
    assert pairs[0].prefix == "sub-01_hemi-L_space-fsaverage_desc-otreg_"
    check_names(pairs)


def test_output_names_parse_as_bids_derivatives(derivatives, templates):
    from bids.layout import parse_file_entities

    with pytest.warns(UserWarning):
        pairs = bids_pairs(
            find_inputs(derivatives), {"L": templates["L"], "R": templates["R"]}, "fsLR"
        )
    name = f"/{pairs[2].folder}/{pairs[2].prefix}metrics.json"
    entities = parse_file_entities(name, config=["bids", "derivatives"])
    assert {k: entities.get(k) for k in ("subject", "session", "hemi", "space", "desc")} == {
        "subject": "02",
        "session": "1",
        "hemi": "L",
        "space": "fsLR",
        "desc": "otreg",
    }


def test_white_surfaces_and_one_hemisphere(derivatives):
    with pytest.warns(UserWarning, match=r"missing .*_hemi-R_white.surf.gii\): sub-03$"):
        inputs = find_inputs(derivatives, surface="white", hemispheres="R")
    assert [i.path.name for i in inputs] == [
        "sub-01_hemi-R_white.surf.gii",
        "sub-02_ses-1_hemi-R_white.surf.gii",
        "sub-02_ses-2_hemi-R_white.surf.gii",
    ]


def test_segmentations_with_a_label(derivatives, templates):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every subject has its aseg: nothing missing
        inputs = find_inputs(derivatives, label=17)
    assert summary(inputs) == [
        ("01", None, None, "dseg", "sub-01_desc-aseg_dseg.nii.gz"),
        ("02", "1", None, "dseg", "sub-02_ses-1_desc-aseg_dseg.nii.gz"),
        ("02", "2", None, "dseg", "sub-02_ses-2_desc-aseg_dseg.nii.gz"),
        ("03", None, None, "dseg", "sub-03_desc-aseg_dseg.nii.gz"),
    ]
    assert all(i.label == 17 for i in inputs)
    assert load_shape(inputs[0].path, label=inputs[0].label).n_faces > 0
    pairs = bids_pairs(inputs, templates["seg"], "MNI152NLin2009cAsym", options={"sigma": 5.0})
    assert pairs[1].pair_id == "sub-02_ses-1_label-17"
    assert pairs[1].prefix == "sub-02_ses-1_space-MNI152NLin2009cAsym_label-17_desc-otreg_"
    assert pairs[1].folder == "sub-02/ses-1/anat"
    assert (pairs[1].label, pairs[1].hemisphere, dict(pairs[1].options)) == (
        17.0,
        None,
        {"sigma": 5.0},
    )
    check_names(pairs)
    with pytest.raises(ValueError, match="one template file"):
        bids_pairs(inputs, {"L": templates["L"], "R": templates["R"]}, "fsaverage")


def test_two_files_for_one_input_are_refused(derivatives):
    gifti(derivatives / "sub-01/anat/sub-01_acq-x_hemi-L_pial.surf.gii")
    with pytest.raises(ValueError, match="several files for one input.*sub-01_acq-x_hemi-L"):
        find_inputs(derivatives, ["01"])


# ----------------------------------------------------------------------------- participants


def test_participant_labels_with_or_without_sub(derivatives, monkeypatch):
    from bids.layout import BIDSLayoutIndexer

    indexed, index_file = [], BIDSLayoutIndexer._index_file

    def spy(self, path, entities):
        indexed.append(str(path))
        return index_file(self, path, entities)

    monkeypatch.setattr(BIDSLayoutIndexer, "_index_file", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sub-03 (one hemisphere) is not asked for
        inputs = find_inputs(derivatives, ["01", "sub-02", "01"])
    assert sorted({i.subject for i in inputs}) == ["01", "02"] and len(inputs) == 6
    assert indexed and not any("sub-03" in p for p in indexed)  # only those asked for are indexed
    assert {i.subject for i in find_inputs(derivatives, "sub-01")} == {"01"}


def test_a_missing_participant_warns_and_the_others_run(derivatives):
    with pytest.warns(UserWarning, match="participant label.*04") as record:
        inputs = find_inputs(derivatives, ["04", "sub-01"])
    assert len(record) == 1
    assert summary(inputs)[0][:3] == ("01", None, "L") and len(inputs) == 2


def test_no_matching_participant_is_an_error(derivatives):
    with pytest.raises(ValueError, match=r"04, 05.*subjects there: 01, 02, 03"):
        find_inputs(derivatives, ["sub-04", "05"])


# ----------------------------------------------------------------------------- FreeSurfer


def test_freesurfer_subjects_dir(tmp_path, templates):
    root = freesurfer_tree(tmp_path / "subjects")
    inputs = find_inputs(root)
    assert summary(inputs) == [
        ("01", None, "L", "surface", "lh.pial"),
        ("01", None, "R", "surface", "rh.pial"),
        ("OAS1_0002", None, "L", "surface", "lh.pial"),
        ("OAS1_0002", None, "R", "surface", "rh.pial"),
    ]
    assert inputs[1].path == root / "sub-01" / "surf" / "rh.pial"
    assert inputs[2].path == root / "OAS1_0002" / "surf" / "lh.pial"
    shape = load_shape(inputs[0].path)
    assert np.allclose(shape.points.numpy(), TETRA + CRAS, atol=1e-5)  # shifted by c_ras

    with pytest.warns(UserWarning, match="OAS1_0002 -> sub-OAS10002"):
        pairs = bids_pairs(inputs, {"L": templates["L"], "R": templates["R"]}, "fsaverage")
    assert [(p.pair_id, p.folder, p.source_subject) for p in pairs[1:3]] == [
        ("sub-01_hemi-R", "sub-01/anat", "01"),
        ("sub-OAS10002_hemi-L", "sub-OAS10002/anat", "OAS1_0002"),
    ]
    check_names(pairs)
    assert [i.subject for i in find_inputs(root, ["sub-01"], kind="freesurfer")] == ["01", "01"]


def test_freesurfer_segmentations_and_missing_hemispheres(tmp_path):
    root = freesurfer_tree(tmp_path / "subjects")
    (root / "OAS1_0002" / "surf" / "rh.pial").unlink()
    inputs = find_inputs(root, label=53)
    assert [(i.subject, i.path) for i in inputs] == [
        ("01", root / "sub-01" / "mri" / "aseg.mgz"),
        ("OAS1_0002", root / "OAS1_0002" / "mri" / "aseg.mgz"),
    ]
    assert load_shape(inputs[0].path, label=53).n_faces > 0
    with pytest.warns(UserWarning, match="OAS1_0002_hemi-R"):
        assert len(find_inputs(root)) == 3


def test_one_template_for_both_hemispheres_warns(tmp_path, templates):
    inputs = find_inputs(freesurfer_tree(tmp_path / "s"), ["01"])
    with pytest.warns(UserWarning, match="one template .* both hemispheres"):
        pairs = bids_pairs(inputs, templates["L"], "fsaverage")
    assert {p.target for p in pairs} == {str(templates["L"])}


# ----------------------------------------------------------------------------- detection, errors


def test_auto_detection_and_forced_kinds(derivatives, tmp_path):
    subjects = freesurfer_tree(tmp_path / "subjects")
    assert find_inputs(subjects, kind="auto")[0].path.name == "lh.pial"
    assert find_inputs(derivatives, ["01"], kind="bids")[0].path.suffixes == [".surf", ".gii"]
    with pytest.raises(ValueError, match="no FreeSurfer subjects"):
        find_inputs(derivatives, kind="freesurfer")


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        find_inputs(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither a BIDS dataset.*dataset_description.*surf/"):
        find_inputs(tmp_path / "empty")
    freesurfer(tmp_path / "bert" / "surf" / "lh.pial")
    with pytest.raises(ValueError, match="one FreeSurfer subject"):
        find_inputs(tmp_path / "bert")
    with pytest.raises(ValueError, match="not a folder"):
        find_inputs(tmp_path / "bert" / "surf" / "lh.pial")
    description(tmp_path / "nothing", DatasetType="derivative", GeneratedBy=[{"Name": "x"}])
    with pytest.raises(ValueError, match=r"no inputs in .*hemi-L\|R_pial.surf.gii"):
        find_inputs(tmp_path / "nothing")


def test_raw_bids_without_and_with_derivatives(tmp_path):
    raw = tmp_path / "raw"
    description(raw)  # no DatasetType: raw, as BIDS defaults
    (raw / "sub-01" / "anat").mkdir(parents=True)
    (raw / "sub-01" / "anat" / "sub-01_T1w.nii.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="raw BIDS dataset; point at fMRIPrep or sMRIPrep"):
        find_inputs(raw)
    fmriprep_tree(raw / "derivatives" / "fmriprep", subjects=[("01", None)])
    with pytest.warns(UserWarning, match=r"raw BIDS dataset: reading .*derivatives/fmriprep"):
        inputs = find_inputs(raw)
    assert [i.path.parent for i in inputs] == [raw / "derivatives/fmriprep/sub-01/anat"] * 2


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(root=3), TypeError, "root must be a path"),
        (dict(participant_label=1), TypeError, "participant_label must be"),
        (dict(participant_label=["01", 2]), TypeError, "participant_label must be"),
        (dict(participant_label=[]), ValueError, "participant_label is empty"),
        (dict(participant_label=["sub-"]), ValueError, "empty label"),
        (dict(surface=1), TypeError, "surface must be a string"),
        (dict(surface="sphere"), ValueError, "surface is .*allowed: pial, white"),
        (dict(hemispheres=0), TypeError, "hemispheres must be"),
        (dict(hemispheres=["L", "lh"]), ValueError, "hemispheres is .*allowed: L, R"),
        (dict(hemispheres=()), ValueError, "hemispheres is empty"),
        (dict(kind="raw"), ValueError, "kind is .*allowed: auto, bids, freesurfer"),
        (dict(kind=None), TypeError, "kind must be a string"),
        (dict(label="17"), TypeError, "label must be an integer"),
        (dict(label=True), TypeError, "label must be an integer"),
        (dict(label=0), ValueError, "label is 0"),
        (dict(database=1.5), TypeError, "database must be a path"),
    ],
)
def test_bad_arguments(derivatives, kwargs, error, match):
    kwargs = {"root": derivatives, **kwargs}
    with pytest.raises(error, match=match):
        find_inputs(**kwargs)


def test_bad_pair_arguments(derivatives, templates, tmp_path):
    inputs = find_inputs(derivatives, ["01"])
    tpl = {"L": templates["L"], "R": templates["R"]}
    with pytest.raises(ValueError, match="not a BIDS label"):
        bids_pairs(inputs, tpl, "fs_average")
    with pytest.raises(TypeError, match="template_id must be a string"):
        bids_pairs(inputs, tpl, None)
    with pytest.raises(TypeError, match="non-empty list"):
        bids_pairs([], tpl, "fsaverage")
    with pytest.raises(TypeError, match="SubjectInput"):
        bids_pairs(["sub-01"], tpl, "fsaverage")
    with pytest.raises(ValueError, match="needs \\['L', 'R'\\]"):
        bids_pairs(inputs, {"L": templates["L"]}, "fsaverage")
    with pytest.raises(ValueError, match="needs"):
        bids_pairs(inputs, {**tpl, "left": templates["L"]}, "fsaverage")
    with pytest.raises(FileNotFoundError, match="nope.gii"):
        bids_pairs(inputs, {**tpl, "R": tmp_path / "nope.gii"}, "fsaverage")
    with pytest.raises(ValueError, match="unknown option 'iters'"):
        bids_pairs(inputs, tpl, "fsaverage", options={"iters": 3})
    with pytest.raises(ValueError, match="a surface needs a hemisphere"):
        SubjectInput("01", None, None, tmp_path / "x.gii")
    twice = [inputs[0], SubjectInput("01", None, "L", tmp_path / "other.gii")]
    with pytest.raises(ValueError, match="both give sub-01_hemi-L"):
        bids_pairs(twice, tpl, "fsaverage")


def test_without_pybids(derivatives, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bids", None)
    with pytest.raises(ImportError, match=r"pip install 'otreg\[batch\]'"):
        find_inputs(derivatives)
    assert len(find_inputs(freesurfer_tree(tmp_path / "s"))) == 4  # FreeSurfer needs no pybids


# ----------------------------------------------------------------------------- database


def test_the_database_is_built_once_and_reused(derivatives, tmp_path):
    db = tmp_path / "cache" / "index"
    first = find_inputs(derivatives, ["01", "02"], database=db)
    index = db / "layout_index.sqlite"
    stamp = (index.stat().st_mtime_ns, index.stat().st_size)
    assert [p.name for p in db.parent.iterdir()] == ["index"]  # no temporary folder left
    gifti(derivatives / "sub-04/anat/sub-04_hemi-L_pial.surf.gii")  # added after indexing
    again = find_inputs(derivatives, ["01", "02"], database=str(db))
    assert again == first and (index.stat().st_mtime_ns, index.stat().st_size) == stamp
    with pytest.warns(UserWarning, match="participant label.*04"):  # the stored index is used
        find_inputs(derivatives, ["01", "04"], database=db)
    with pytest.warns(UserWarning, match="sub-04_hemi-R"):  # a fresh index sees sub-04
        assert [i.subject for i in find_inputs(derivatives, ["04"])] == ["04"]
    with sqlite3.connect(index) as db_:  # the index holds anat folders only
        paths = [row[0] for row in db_.execute("SELECT path FROM files")]
    assert any("/anat/" in p for p in paths) and not any("/func/" in p for p in paths)
    assert not any("sourcedata" in p for p in paths)
    other = fmriprep_tree(tmp_path / "other", subjects=[("01", None)])
    with pytest.raises(ValueError, match="indexes .*fmriprep, not .*other"):
        find_inputs(other, database=db)
    with pytest.raises(ValueError, match="must be a folder"):
        find_inputs(derivatives, database=index)


# ----------------------------------------------------------------------------- description


def test_dataset_description(tmp_path, derivatives):
    out = tmp_path / "out"
    path = write_dataset_description(out, derivatives)
    info = json.loads(path.read_text())
    assert path == out / "dataset_description.json"
    assert info["DatasetType"] == "derivative" and info["BIDSVersion"] == "1.10.0"
    assert info["GeneratedBy"][0]["Name"] == "otreg" and info["GeneratedBy"][0]["Version"]
    assert info["SourceDatasets"] == [{"URL": derivatives.as_uri()}]
    stamp = path.stat().st_mtime_ns
    assert write_dataset_description(out, str(derivatives)) == path
    assert path.stat().st_mtime_ns == stamp and json.loads(path.read_text()) == info
    write_dataset_description(out, tmp_path / "second")
    urls = [s["URL"] for s in json.loads(path.read_text())["SourceDatasets"]]
    assert urls == [derivatives.as_uri(), (tmp_path / "second").as_uri()]


def test_a_foreign_description_is_not_overwritten(tmp_path, derivatives):
    before = (derivatives / "dataset_description.json").read_text()
    with pytest.raises(ValueError, match=r"not written by otreg.*fMRIPrep"):
        write_dataset_description(derivatives, tmp_path)
    assert (derivatives / "dataset_description.json").read_text() == before
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "dataset_description.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        write_dataset_description(tmp_path / "bad", derivatives)


def test_an_interrupted_index_leaves_no_database(derivatives, tmp_path, monkeypatch):
    from bids.layout import BIDSLayoutIndexer

    index_all = BIDSLayoutIndexer.__call__

    def interrupted(self, layout):
        index_all(self, layout)
        raise KeyboardInterrupt

    monkeypatch.setattr(BIDSLayoutIndexer, "__call__", interrupted)
    db = tmp_path / "cache" / "index"
    with pytest.raises(KeyboardInterrupt):
        find_inputs(derivatives, ["01"], database=db)
    assert not (db / "layout_index.sqlite").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []
    monkeypatch.setattr(BIDSLayoutIndexer, "__call__", index_all)
    assert len(find_inputs(derivatives, ["01"], database=db)) == 2


# ----------------------------------------------------------------------------- carried values


def test_pairs_carry_each_subjects_values_and_the_templates(derivatives, templates, tmp_path):
    """carry finds each subject's named per-vertex file beside its surface; the template's
    values go to every pair of their hemisphere; a subject without the file is named."""
    inputs = find_inputs(derivatives, ["01"])
    for i in inputs:
        stem = i.path.name.rsplit("_", 1)[0]
        nib.save(
            nib.GiftiImage(darrays=[nib.gifti.GiftiDataArray(np.ones(4, np.float32))]),
            str(i.path.parent / f"{stem}_thickness.shape.gii"),
        )
    atlas = {h: tmp_path / f"atlas.{h}.label.gii" for h in ("L", "R")}
    for path in atlas.values():
        path.write_bytes(b"read by the job")
    pairs = bids_pairs(
        inputs, {"L": templates["L"], "R": templates["R"]}, "tpl", carry="thickness",
        template_values={"L": [atlas["L"]], "R": str(atlas["R"])},
    )  # fmt: skip
    assert [Path(p.source_values[0]).name for p in pairs] == [
        "sub-01_hemi-L_thickness.shape.gii",
        "sub-01_hemi-R_thickness.shape.gii",
    ]
    assert [p.target_values for p in pairs] == [(str(atlas["L"]),), (str(atlas["R"]),)]
    with pytest.raises(FileNotFoundError, match="no 'curv' values for sub-01_hemi-L_pial"):
        bids_pairs(inputs, {"L": templates["L"], "R": templates["R"]}, "tpl", carry=["curv"])
    with pytest.raises(ValueError, match=r"template_values has the keys \['L'\]; it needs"):
        bids_pairs(
            inputs, {"L": templates["L"], "R": templates["R"]}, "tpl", template_values={"L": []}
        )
    with pytest.raises(ValueError, match="two templates .* take their values as"):
        bids_pairs(inputs, {"L": templates["L"], "R": templates["R"]}, "tpl", template_values=[])
    with pytest.raises(ValueError, match="carry name '../x' must be letters"):
        bids_pairs(inputs, {"L": templates["L"], "R": templates["R"]}, "tpl", carry="../x")


def test_freesurfer_subjects_carry_curvature_files_and_annotations(tmp_path, templates):
    root = freesurfer_tree(tmp_path / "subjects")
    (root / "sub-01" / "surf" / "lh.thickness").write_bytes(b"x")
    (root / "sub-01" / "label").mkdir()
    (root / "sub-01" / "label" / "lh.aparc.annot").write_bytes(b"x")
    inputs = find_inputs(root, ["sub-01"], hemispheres="L")
    (pair,) = bids_pairs(inputs, templates["L"], "fsaverage", carry=["thickness", "aparc"])
    assert [Path(f).name for f in pair.source_values] == ["lh.thickness", "lh.aparc.annot"]
